"""DualPipeV as the engine's schedule protocol sees it (nam_core.engine.megatron.schedule.PipelineSchedule):
the V's stages in the lowering, the layouts it refuses, its embedding group and shared copies."""

from __future__ import annotations

import pytest
import torch

from nam56r.megatron import NamMegatronModel, check_lowering, lower
from nam56r.model import Backends
from nam56r.recipes import get_recipe
from nam56r.run import RunRequest, activate, resolve
from nam_core.device import DeviceInfo
from nam_core.engine import megatron as engine
from nam_core.engine.config import TrainConfig
from nam_core.errors import ConfigError
from nam_core.host import PluginHost
from nam_plugin_dualpipev.engine import DualPipeV


@pytest.fixture(scope="module")
def cfg():
    return get_recipe("nam56r").model


def test_the_v_folds_twice_as_many_stages(cfg):
    """pp=2: 4 stages of 13 layers; rank 0 holds stages 0 and 3 (embeddings, and the output layer with MTP),
    rank 1 stages 1 and 2, in chunk order (down, then back up)."""
    lowering = lower(cfg, pp=2, schedule=DualPipeV())
    main = lowering.hybrid_layer_pattern.split("/")[0]
    assert [len(seg) for seg in main.split("|")] == [13, 13, 13, 13]
    assert main.replace("|", "") == lower(cfg).main_pattern  # the stages in stage order
    assert lowering.chunks == 2 and lowering.schedule == "dualpipev" and not lowering.megatron_order
    assert lowering.stage_map == ((0, 3), (1, 2))
    by_stage = {(l["pp_stage"], l["pp_rank"], l["chunk"]) for l in lowering.layers}
    assert by_stage == {(0, 0, 0), (1, 1, 0), (2, 1, 1), (3, 0, 1)}
    v = DualPipeV()
    assert [v.stage_of(r, c, 4) for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    with pytest.raises(ConfigError, match=r"pipeline stages=8 must divide num_layers, found num_layers=52"):
        lower(cfg, pp=4, schedule=DualPipeV())  # 1F1B takes pp=4 (13 a stage); the V needs 8 stages
    assert lower(cfg, pp=4).chunks == 1


def test_the_v_refuses_expert_parallelism_short_pipelines_and_few_microbatches():
    train = TrainConfig(device="cuda", dtype="bfloat16", schedule="dualpipev", grad_accum=4)
    registered = {"dualpipev": DualPipeV}
    with pytest.raises(ConfigError, match=r"dualpipev runs only with expert parallelism 1, found ep=2"):
        engine.check_layout(world_size=4, tp=1, pp=2, ep=2, train=train, registered_schedules=registered)
    with pytest.raises(ConfigError, match=r"dualpipev needs pipeline parallelism > 1, found pp=1"):
        engine.check_layout(world_size=2, tp=1, pp=1, ep=1, train=train, registered_schedules=registered)
    with pytest.raises(ConfigError, match=r"grad_accum >= 2 x pp = 4, found 2"):
        engine.check_layout(world_size=2, tp=1, pp=2, ep=1, train=train.replace(grad_accum=2),
                            registered_schedules=registered)
    assert engine.check_layout(world_size=2, tp=1, pp=2, ep=1, train=train, registered_schedules=registered) == 1


def test_the_lowering_needs_the_registered_schedule_and_binds_to_it(cfg):
    """Lowered from the name before the plugin is active (``nam56r.run.resolve``): one chunk per rank, refused by
    the model against the registered V; ``nam56r.run.activate`` lowers again with the registered schedule's
    instance, which the model takes."""
    early = lower(cfg, pp=2, schedule="dualpipev")
    assert (early.schedule, early.chunks) == ("dualpipev", 1)
    assert "dualpipev schedule" in {g.what for g in early.gaps if g.status == "covered"}
    with pytest.raises(ConfigError, match="no registered schedule of that name"):
        check_lowering(early, registered_schedules={})
    with pytest.raises(ConfigError, match=r"lowered for stages \[\[0\], \[1\]\], the registered schedule 'dualpipev' "
                                          r"runs \[\[0, 3\], \[1, 2\]\]"):
        NamMegatronModel(cfg, Backends.reference(), early, seed=0).check(registered_schedules={"dualpipev": DualPipeV})

    host = PluginHost()
    run = resolve(RunRequest(recipe="nam56r-tiny", plugins=["dualpipev"], engine="megatron", device="cuda", pp=2,
                             nproc=2, env_plugins=False,
                             overrides=["attention_backend=reference", "train.schedule=dualpipev",
                                        "train.grad_accum=4"]), host)
    assert (run.lowering.schedule, run.lowering.chunks) == ("dualpipev", 1)
    run = activate(run, host, DeviceInfo.profile("h100"))
    assert run.lowering.chunks == 2 and run.lowering.stage_map == ((0, 3), (1, 2))
    tiny = get_recipe("nam56r-tiny").model
    assert run.lowering.hybrid_layer_pattern == lower(tiny, pp=2, schedule=DualPipeV()).hybrid_layer_pattern
    model = NamMegatronModel(run.spec.model, Backends.reference(), run.lowering, seed=0)
    model.check(registered_schedules={"dualpipev": DualPipeV})
    assert model.chunks == 2


def test_the_v_keeps_the_embedding_group_to_the_first_rank_and_sums_the_copies():
    """A V holds the token embedding (stage 0) and its MTP copy (last stage) on pipeline rank 0: Megatron's
    embedding group shrinks to that rank, and the two copies' gradients are summed there, nothing else."""
    v = DualPipeV()
    assert v.embedding_ranks()([4, 5, 6, 7]) == [4]
    chunks = [torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(3, 2, bias=False)]
    other = torch.nn.Linear(3, 3, bias=False)
    chunks[1].add_module("other", other)
    grads = [torch.randn(2, 3), torch.randn(2, 3)]
    for chunk, grad in zip(chunks, grads):
        chunk.weight.shared_embedding = True
        chunk.weight.main_grad = grad.clone()
    other.weight.main_grad = torch.randn(3, 3)
    untouched = other.weight.main_grad.clone()
    v.reduce_shared_copies(chunks)
    for chunk in chunks:
        torch.testing.assert_close(chunk.weight.main_grad, grads[0] + grads[1], rtol=0, atol=0)
    assert torch.equal(other.weight.main_grad, untouched)
    v.reduce_shared_copies(chunks[:1])  # one chunk: Megatron's embedding all-reduce, not this, keeps copies equal
    torch.testing.assert_close(chunks[0].weight.main_grad, grads[0] + grads[1], rtol=0, atol=0)
