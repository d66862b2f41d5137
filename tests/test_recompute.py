"""Activation recompute (nam56r/recompute.py): for each kind, NAM56R-tiny's loss and every gradient equal the
run without recompute bit for bit (tolerance 0), the recomputed blocks really run twice, and the config."""

import dataclasses

import pytest
import torch

from nam56r import recompute
from nam56r.model import Backends, Layer, build_model
from nam56r.recipes import get_recipe
from nam56r.state import ForwardState
from nam_core.device import DeviceInfo
from nam_core.engine.config import TrainConfig, recompute_kinds
from nam_core.errors import ConfigError
from nam_core.host import PluginHost


def _tiny(indexer: str = "full"):
    """NAM56R-tiny cut to 14 layers (AEMEDEMEDEMMDE: every kind, three DSA layers so IndexCache's default
    FSS places one Full and two Shared) and rows of 32, to stay cheap on 2 cores."""
    recipe = get_recipe("nam56r-tiny")
    cfg = dataclasses.replace(recipe.model, seq_len=32, num_layers=14, mla_attention_ranks=(0,),
                              indexer_backend=indexer)
    host = PluginHost()
    host.activate(["reference", *(["index-cache"] if indexer == "index-cache" else [])], DeviceInfo.profile("cpu"))
    torch.manual_seed(0)
    return cfg, build_model(cfg, Backends.from_registries(host.registries, cfg))


def _batch(cfg, seed=3):
    g = torch.Generator().manual_seed(seed)
    b, s = 2, cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, s),
                segment_ids=(torch.arange(s) >= s // 3).long().expand(b, s).contiguous(),
                structure=torch.randint(0, cfg.structure_vocab, (b, s), generator=g))


def _loss_and_grads(model, batch) -> tuple[dict, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, state=ForwardState(micro_batch=0, seq_layout=tuple(batch["tokens"].shape)))
    out["loss"].backward()
    return ({k: v.detach().clone() for k, v in out.items()},
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def _mixer_calls(model) -> dict[str, int]:
    """Forward calls per layer kind, counted as they start (a recomputed mixer runs twice per step; torch stops
    a replay once backward has every tensor it needs, so the end of the replay may never come)."""
    calls: dict[str, int] = {}
    for layer in model.modules():
        if isinstance(layer, Layer):
            layer.mixer.register_forward_pre_hook(
                lambda mod, args, kind=layer.spec.kind: calls.__setitem__(kind, calls.get(kind, 0) + 1))
    return calls


@pytest.fixture(scope="module", params=["full", "index-cache"])
def reference(request):
    """A model, its batch, and its loss, gradients and mixer calls without recompute."""
    cfg, model = _tiny(request.param)
    batch = _batch(cfg)
    calls = _mixer_calls(model)
    out, grads = _loss_and_grads(model, batch)
    return model, batch, out, grads, dict(calls), calls


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [("mamba",), ("moe",), ("attention",), ("layer",), ("mamba", "moe", "attention")])
def test_recompute_is_bit_exact_against_none(reference, kinds):
    model, batch, ref_out, ref_grads, once, calls = reference
    calls.clear()
    lines = recompute.apply(model, kinds)
    assert lines and all("activation recompute" in line for line in lines)
    try:
        out, grads = _loss_and_grads(model, batch)
    finally:
        recompute.apply(model, ())
    for key in ref_out:
        assert torch.equal(out[key], ref_out[key]), key
    assert grads.keys() == ref_grads.keys() and len(grads) > 50
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    covered = {k for k, v in recompute.KIND_OF_LAYER.items() if v in kinds or "layer" in kinds}
    for kind, n in once.items():  # recomputed mixers ran again in backward; the others did not
        assert calls[kind] == (2 * n if kind in covered else n), kind


class ReplayBlindScan:
    """A scan backend whose ``for_backward_only`` runs the scan (so autograd saves what it saves) and returns NaNs
    in place of its output: a mixer that read a replay's output would carry them into the gradients."""

    def __init__(self, scan, log: list):
        self.scan, self.log = scan, log

    def __call__(self, *args, **kwargs):
        self.log.append("call")
        return self.scan(*args, **kwargs)

    def for_backward_only(self, *args, **kwargs):
        self.log.append("for_backward_only")
        return torch.full_like(self.scan(*args, **kwargs), float("nan"))


@pytest.mark.slow
def test_mamba_scan_is_bit_exact_and_replays_only_between_the_projections(reference):
    """``mamba-scan``: loss and every gradient equal the run without recompute (tolerance 0) even though the
    replay's scan output is NaN (it is never read); each mixer's scan runs once as a call and once for backward
    only, in_proj and out_proj once; marking ``mamba`` afterwards clears the mixers' own mark (a whole
    recomputed mixer does not checkpoint inside itself too)."""
    from nam56r.blocks.mamba3 import Mamba3Mixer

    model, batch, ref_out, ref_grads, once, calls = reference
    log, in_proj, out_proj = [], [], []
    mixers = [m for m in model.modules() if isinstance(m, Mamba3Mixer)]
    for m in mixers:
        m.scan = ReplayBlindScan(m.scan, log)
    handles = [m.in_proj.register_forward_pre_hook(lambda *a: in_proj.append(1)) for m in mixers]
    handles += [m.out_proj.register_forward_pre_hook(lambda *a: out_proj.append(1)) for m in mixers]
    calls.clear()
    assert recompute.apply(model, ("mamba-scan",)) == [
        f"activation recompute: mamba-scan in {once['mamba']} layers (train.recompute)"]
    try:
        out, grads = _loss_and_grads(model, batch)
    finally:
        recompute.apply(model, ("mamba",))
        assert not any(m.recompute_scan for m in mixers)
        recompute.apply(model, ())
        for h in handles:
            h.remove()
        for m in mixers:
            m.scan = m.scan.scan
    for key in ref_out:
        assert torch.equal(out[key], ref_out[key]), key
    assert grads.keys() == ref_grads.keys() and len(grads) > 50
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    assert len(mixers) == once["mamba"] > 0
    assert sorted(log) == ["call"] * len(mixers) + ["for_backward_only"] * len(mixers)
    assert len(in_proj) == len(out_proj) == len(mixers) == calls["mamba"]


def test_a_replay_sees_state_recompute_and_leaves_the_state_as_it_was():
    """The replay runs with ``state.recompute`` set (what DSA's indexer strategies read) and its aux losses
    and log lines are dropped: the first pass recorded them once."""
    seen = []

    def block(x, state):
        seen.append(state.recompute)
        state.add_loss("aux", x.sum() * 0.0 + 1.0)
        state.log.append("line")
        return x.sin()

    state = ForwardState()
    x = torch.randn(3, requires_grad=True)
    recompute.checkpointed(block, state, x).sum().backward()
    assert seen == [False, True]
    assert len(state.aux_losses["aux"]) == 1 and state.log == ["line"] and state.recompute is False
    assert torch.equal(x.grad, x.detach().cos())


def test_inside_checkpointed_answers_true_in_both_passes_and_false_outside():
    """A backend that saves more inside ``checkpointed`` (nam-plugin-mimo-scan's chunk states) must be told so in
    the first pass and in the replay alike (torch's checkpoint matches the replay's saved tensors to the first
    pass's one for one), and not outside, nor after the region (also after a body that raised)."""
    seen = []

    def block(x, state):
        seen.append(recompute.inside_checkpointed())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    assert not recompute.inside_checkpointed()
    y = recompute.checkpointed(block, None, x)
    assert not recompute.inside_checkpointed()
    y.sum().backward()
    assert seen == [True, True] and not recompute.inside_checkpointed()

    def failing(x, state):
        raise RuntimeError("in the body")

    with pytest.raises(RuntimeError, match="in the body"):
        recompute.checkpointed(failing, None, x)
    assert not recompute.inside_checkpointed()


def test_recompute_config_presets_and_refusals():
    assert recompute_kinds(TrainConfig()) == ()
    assert recompute_kinds(TrainConfig(recompute=("mixers",))) == ("mamba", "moe", "attention")
    assert recompute_kinds(TrainConfig(recompute=("moe", "mamba"))) == ("mamba", "moe")
    assert recompute_kinds(TrainConfig(recompute=("full",))) == ("layer",)
    from nam56r.run import RunRequest, resolve

    run = resolve(RunRequest(overrides=["train.recompute=mamba,attention"], env_plugins=False))
    assert run.spec.train.recompute == ("mamba", "attention")
    with pytest.raises(ConfigError, match="alone"):
        resolve(RunRequest(overrides=["train.recompute=layer,mamba"], env_plugins=False))
    with pytest.raises(ConfigError, match="not both"):
        resolve(RunRequest(overrides=["train.recompute=mamba,mamba-scan"], env_plugins=False))
    assert recompute_kinds(TrainConfig(recompute=("moe", "mamba-scan"))) == ("mamba-scan", "moe")
    with pytest.raises(ConfigError, match="expected one of mamba, mamba-scan, moe, attention, layer"):
        resolve(RunRequest(overrides=["train.recompute=experts"], env_plugins=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_scan_replay_of_the_inductor_compiled_prelude_is_bit_exact(dtype):
    """``mamba_compile_prelude`` (inductor, as the nam56r recipe runs it) with ``compile_glue`` on: the
    ``mamba-scan`` replay runs the compiled prelude again inside backward, and loss and every gradient equal the
    run without recompute bit for bit (tolerance 0), fp32 and bf16 (the prelude's dt and A dt stay fp32)."""
    import copy

    from nam56r.blocks.mamba3 import Mamba3Mixer
    from nam56r.reference.mamba3 import ReferenceSSMScan
    from nam_core.testing import new_seed

    seed = new_seed()
    torch.manual_seed(seed)
    cfg = get_recipe("nam56r-tiny").model.replace(hidden=32, d_state=16, mamba_headdim=8, mamba_ngroups=2,
                                                  mamba_chunk=8, mamba_compile_prelude=True, compile_glue=True)
    plain = Mamba3Mixer(cfg, ReferenceSSMScan()).to(dtype)
    replayed = copy.deepcopy(plain)
    replayed.recompute_scan = True
    x = torch.randn(2, 24, cfg.hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    passes = {"plain": _count_between(plain), "replayed": _count_between(replayed)}

    def grads(m):
        xx = x.clone().requires_grad_()
        m(xx).float().square().mean().backward()
        return [xx.grad, *(p.grad for p in m.parameters())]

    for got, want in zip(grads(replayed), grads(plain), strict=True):
        assert torch.equal(got, want), seed
    assert passes == {"plain": [True], "replayed": [True, False]}  # the replay ran, its output dropped


def _count_between(mixer) -> list:
    """Calls of ``mixer._between`` (the prelude and the scan) from now on, as whether each one's output is used:
    one call a step without recompute, two with the ``mamba-scan`` replay (the replay's output dropped)."""
    calls, real = [], mixer._between

    def between(*args, **kwargs):
        calls.append(kwargs.get("output_used", True))
        return real(*args, **kwargs)

    mixer._between = between
    return calls


def test_mamba_scan_replay_with_a_split_in_proj_is_bit_exact():
    """``mamba_split_in_proj``: the checkpointed region's inputs are in_proj's three parts; the replay equals the
    run without recompute bit for bit (tolerance 0)."""
    import copy

    from nam56r.blocks.mamba3 import Mamba3Mixer
    from nam56r.reference.mamba3 import ReferenceSSMScan
    from nam_core.testing import new_seed

    seed = new_seed()
    torch.manual_seed(seed)
    cfg = get_recipe("nam56r-tiny").model.replace(hidden=32, d_state=16, mamba_headdim=8, mamba_ngroups=2,
                                                  mamba_chunk=8, mamba_split_in_proj=True)
    plain = Mamba3Mixer(cfg, ReferenceSSMScan())
    replayed = copy.deepcopy(plain)
    replayed.recompute_scan = True
    x = torch.randn(2, 24, cfg.hidden, generator=torch.Generator().manual_seed(seed))
    passes = {"plain": _count_between(plain), "replayed": _count_between(replayed)}

    def grads(m):
        xx = x.clone().requires_grad_()
        m(xx).square().mean().backward()
        return [xx.grad, *(p.grad for p in m.parameters())]

    for got, want in zip(grads(replayed), grads(plain), strict=True):
        assert torch.equal(got, want), seed
    assert passes == {"plain": [True], "replayed": [True, False]}  # the replay ran, its output dropped
