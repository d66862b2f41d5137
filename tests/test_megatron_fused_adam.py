"""nam's reading and filling of Megatron's optimizer state when its inner Adam is Transformer Engine's FusedAdam
(what Megatron-Core builds on a host with TE), on the CPU: TE does not install here, so
tests/megatron_gloo/fused_adam.py stands in for it (its docstring lists what of FusedAdam's layout it keeps: the
step in each parameter group, exp_avg/exp_avg_sq made lazily). The whole path through Megatron's distributed
optimizer, checkpoint, export and --init-from is tests/test_megatron_engine_gloo.py's
``test_fused_adams_state_crosses_both_ways``; these take seconds."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nam_core.engine.megatron import optimizer as megatron_optimizer
from nam_core.errors import ConfigError

_spec = importlib.util.spec_from_file_location("fused_adam_stand_in",
                                               Path(__file__).parent / "megatron_gloo" / "fused_adam.py")
stand_in = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stand_in)


@pytest.fixture
def te_host(monkeypatch):
    """Megatron's distrib_optimizer as on a host with TE: its ``Adam`` is (here the stand-in for) FusedAdam."""
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "Adam", stand_in.FusedAdam)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)


def _holder(inner, *, precision_aware=False):
    """One of Megatron's optimizers as fill_state reads it: the inner Adam, its config, and its ``init_state_fn``
    (a double of Megatron-Core's for Adam off the precision-aware path: zero moments shaped as each parameter for a
    state that is empty; Megatron's own runs in the gloo test)."""

    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    return SimpleNamespace(optimizer=inner, init_state_fn=init_state_fn,
                           config=SimpleNamespace(use_precision_aware_optimizer=precision_aware))


def test_the_stand_in_keeps_fused_adams_layout():
    """What nam depends on: no state before the first step, then exp_avg/exp_avg_sq and no ``step`` per parameter;
    the step in every group, an empty one's too, advanced before the update."""
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = stand_in.FusedAdam([{"params": [p]}, {"params": []}], lr=1e-2)
    assert len(opt.state) == 0 and all("step" not in g for g in opt.param_groups)
    p.grad = torch.randn(5, 3)
    opt.step()
    opt.step()
    assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq"}
    assert [g["step"] for g in opt.param_groups] == [2, 2]
    assert megatron_optimizer.group_steps(opt) == {2.0}  # the empty group is not read, as Megatron's state_dict


def test_inner_adam_names_megatrons_te_adam_only_where_megatron_builds_it(te_host, monkeypatch):
    p = torch.nn.Parameter(torch.zeros(2))
    assert megatron_optimizer.inner_adam(stand_in.FusedAdam([p])) == "te-fused"
    assert megatron_optimizer.inner_adam(torch.optim.AdamW([p])) == "torch"
    assert megatron_optimizer.inner_adam(torch.optim.SGD([p], lr=0.1)) is None
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", False)  # a host without TE
    assert megatron_optimizer.inner_adam(stand_in.FusedAdam([p])) is None


def test_filled_fused_adam_continues_torch_adamw(te_host):
    """A torch AdamW's moments and step 3 put into a FusedAdam as fill_state puts them (state made by
    ``materialise_state``, moments copied into the tensors Megatron's accessor hands out, ``set_steps``): its step 4
    is torch AdamW's step 4 (fp32, within 1e-6 relative: the two updates round apart). Left at the step FusedAdam
    would count itself (1, after one step), the bias correction makes it differ by more than 1e-3."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    w, grads = torch.randn(16, 8, generator=gen), [torch.randn(16, 8, generator=gen) for _ in range(4)]
    ref = torch.nn.Parameter(w.clone())
    adamw = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads[:3]:
        ref.grad = g.clone()
        adamw.step()
    moments, after3 = {k: adamw.state[ref][k].clone() for k in ("exp_avg", "exp_avg_sq")}, ref.detach().clone()
    ref.grad = grads[3].clone()
    adamw.step()

    results = {}
    for set_step in (True, False):
        p = torch.nn.Parameter(after3.clone())
        holder = _holder(stand_in.FusedAdam([{"params": [p]}, {"params": []}], lr=1e-2, betas=(0.9, 0.95),
                                            eps=1e-8, weight_decay=0.1))
        megatron_optimizer.materialise_state(holder)
        assert set(holder.optimizer.state[p]) == {"exp_avg", "exp_avg_sq"}
        for k, v in moments.items():
            holder.optimizer.state[p][k].copy_(v)
        if set_step:
            megatron_optimizer.set_steps(holder, 3)
            assert [g["step"] for g in holder.optimizer.param_groups] == [3, 3]
        p.grad = grads[3].clone()
        holder.optimizer.step()
        results[set_step] = (p.detach() - ref.detach()).abs().max() / ref.detach().abs().max()
    assert results[True] <= 1e-6, results
    assert results[False] > 1e-3, results


def test_precision_aware_and_unknown_inner_optimizers_are_refused_before_anything_is_filled(te_host):
    p = torch.nn.Parameter(torch.zeros(3))
    aware = _holder(stand_in.FusedAdam([p]), precision_aware=True)
    with pytest.raises(ConfigError) as e:
        megatron_optimizer.fill_state(aware, [], None, None)
    assert "precision-aware optimizer" in str(e.value) and "fp32-master" in e.value.hint
    assert len(aware.optimizer.state) == 0
    with pytest.raises(ConfigError) as e:
        megatron_optimizer.fill_state(_holder(torch.optim.SGD([p], lr=0.1)), [], None, None)
    assert "this run's is SGD" in str(e.value)


def test_the_map_of_a_precision_aware_optimizer_says_why_it_cannot_be_read(tmp_path, te_host):
    """Megatron's precision-aware optimizer (FusedAdam holding the masters as remainders): the rank's optimizer map
    is written incomplete, with the reason and a hint the export shows, so ``nam export --with-optimizer`` refuses
    it instead of exporting 16-bit remainders as masters."""
    import json

    from nam_core.engine.megatron import checkpoint

    p = torch.nn.Parameter(torch.zeros(3))
    holder = _holder(stand_in.FusedAdam([p]), precision_aware=True)
    holder.model_param_group_index_map = {p: (0, 0)}
    tmp = tmp_path / ".step-00000002.tmp"
    tmp.mkdir()
    checkpoint._write_optimizer_map(tmp, {"model": {}, "optimizer": {}}, holder, 0)
    body = json.loads((tmp / checkpoint.OPTIMIZER_MAP / "rank-00000.json").read_text())
    assert body["complete"] is False and body["entries"] == []
    assert "precision-aware optimizer" in body["why"]
    assert f"nam export {tmp_path}/step-00000002 --out DIR" in body["hint"]
