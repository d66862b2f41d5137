"""Optimizer numerics (nam_core/engine/numerics.py): fp32 masters against a naive fp32 reference, the update
bf16 loses and the others keep, bit-exact resume of every choice through a checkpoint, and the refusals."""

import sys

import pytest
import torch

from nam_core.engine import async_checkpoint, checkpoint, numerics
from nam_core.engine.config import TrainConfig
from nam_core.engine.local import lr_lambda, make_optimizer, resume_schedule
from nam_core.errors import CannotRunHere

LR = 1e-3
HP = dict(weight_decay=0.1, lr=LR, betas=(0.9, 0.95), eps=1e-8)


def _mlp(seed: int, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8))
    return model.to(dtype)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def _loss(model, step: int, cast=lambda p: p) -> torch.Tensor:
    x, y = _batch(step)
    h = torch.nn.functional.linear(x.bfloat16(), cast(model[0].weight), cast(model[0].bias))
    out = torch.nn.functional.linear(torch.nn.functional.silu(h), cast(model[2].weight), cast(model[2].bias))
    return (out.float() - y).square().mean()


@pytest.mark.parametrize("chunk", [numerics.GRAD_CHUNK_BYTES, 200])
def test_fp32_master_equals_an_fp32_model_run_in_bf16_bit_for_bit(monkeypatch, chunk):
    """Reference: fp32 weights, each forward on their bf16 cast (autograd hands the fp32 weights the bf16
    gradients, upcast), torch AdamW on the fp32 weights. fp32-master must give the same fp32 masters and the
    same bf16 parameters, exactly (tolerance 0): the same gradients meet the same AdamW. ``chunk`` 200 bytes
    cuts the multi-tensor gradient upcast into four runs (weights of 1024 and 512 bytes alone, the biases)."""
    monkeypatch.setattr(numerics, "GRAD_CHUNK_BYTES", chunk)
    assert len(numerics._chunks(list(_mlp(0).parameters()), lambda p: p.numel() * p.element_size())) == (
        1 if chunk > 2000 else 4)
    model = _mlp(0)
    reference = _mlp(0, torch.float32)
    with torch.no_grad():
        for r, p in zip(reference.parameters(), model.parameters()):
            r.copy_(p.float())  # both start from the same bf16 values
    opt = numerics.make_optimizer(model.parameters(), numerics="fp32-master", **HP)
    ref_opt = torch.optim.AdamW([{"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                lr=LR, betas=(0.9, 0.95), eps=1e-8)
    for step in range(8):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _loss(reference, step, cast=lambda p: p.bfloat16()).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    masters = [m for _, m in opt.nam_masters]
    assert all(m.dtype == torch.float32 for m in masters) and len(masters) == 4
    for m, r, p in zip(masters, reference.parameters(), model.parameters()):
        assert torch.equal(m, r)
        assert p.dtype == torch.bfloat16 and torch.equal(p, r.bfloat16())
    moved = max((r - r0).abs().max().item() for r, r0 in zip(reference.parameters(), _mlp(0).parameters()))
    assert moved > 4 * LR  # the run trained: a test of equal untouched weights would prove nothing


def _small_updates(name: str, steps: int = 20) -> torch.Tensor:
    """4096 bf16 weights at 1.0 (bf16 ulp 2^-7, so half an ulp is 3.9e-3), a gradient of constant sign: Adam's
    step is about lr = 1e-3 each time, a quarter of the half ulp. Returns the weights after ``steps``."""
    w = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    opt = numerics.make_optimizer([w], numerics=name, weight_decay=0.0, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    torch.manual_seed(0)
    for _ in range(steps):
        w.grad = torch.full_like(w, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return w.detach().float()


def test_bf16_loses_small_updates_that_fp32_master_keeps():
    """20 steps of about -1e-3: bf16 rounds each one away (the weights stay exactly 1.0); fp32 masters hold
    1 - 0.02 and the bf16 parameters show it to within half an ulp (0.98 lies between bf16 0.9766 and 0.9805);
    bf16 moments keep it too; stochastic rounding keeps it on average (4096 weights: mean within 1e-3)."""
    assert torch.equal(_small_updates("bf16"), torch.ones(64, 64))
    for name in ("fp32-master", "bf16-moments"):
        w = _small_updates(name)
        assert (w - 0.98).abs().max().item() <= 2 ** -8 / 2 + 1e-6, name
    sr = _small_updates("stochastic-rounding")
    assert abs(sr.mean().item() - 0.98) < 1e-3
    assert len(sr.unique()) > 1  # rounded up or down weight by weight


@pytest.mark.parametrize("name", numerics.NUMERICS)
def test_resume_through_a_checkpoint_is_bit_exact(tmp_path, name):
    """3 steps, a checkpoint, 3 more; against a fresh model that loads the checkpoint and runs the same 3:
    parameters, masters and moments equal bit for bit (stochastic rounding's random bits come from the torch
    RNG, which the checkpoint restores)."""
    cfg = TrainConfig(dtype="bfloat16", optimizer_numerics=name, lr=LR, warmup_steps=2, total_steps=6)

    def start(seed):
        model = _mlp(seed)
        opt = make_optimizer(model, cfg)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))

    def steps(model, opt, sched, first):
        for step in range(first, first + 3):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()

    model, opt, sched = start(0)
    steps(model, opt, sched, 0)
    saved = checkpoint.save(tmp_path, 3, model=model, optimizer=opt, scheduler=sched, extra={}, keep=1)
    steps(model, opt, sched, 3)
    again, opt2, sched2 = start(1)  # other initial weights: everything must come from the checkpoint
    checkpoint.load(saved, model=again, optimizer=opt2, scheduler=sched2)
    resume_schedule(opt2, sched2, cfg)
    steps(again, opt2, sched2, 3)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
    if numerics.MASTER[name]:
        for (_, a), (_, b) in zip(opt.nam_masters, opt2.nam_masters):
            assert a.dtype == torch.float32 and torch.equal(a, b)
    moments = {s["exp_avg"].dtype for s in opt.state.values()}
    assert moments == {torch.float32 if name == "fp32-master" else torch.bfloat16}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_state_filled_by_name_continues_bit_exact(tmp_path, dtype):
    """``nam export --with-optimizer`` and ``nam train --init-from`` it, at the optimizer: a format-3 checkpoint's
    optimizer read back by parameter name (``state_by_name``: AdamW's moments, the fp32 masters of a bf16 model, the
    step count), then ``fill_state`` into a fresh fp32-master optimizer over a model given the exported weights;
    3 more steps equal the original's 3 bit for bit. A missing parameter or a master where this optimizer keeps
    none is a ValueError."""
    cfg = TrainConfig(dtype=dtype, optimizer_numerics="fp32-master", lr=LR, warmup_steps=2, total_steps=6)
    torch_dtype = getattr(torch, dtype)

    def steps(model, opt, first):
        for step in range(first, first + 3):
            _loss(model, step, cast=lambda p: p.to(torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model = _mlp(0, torch_dtype)
    opt = make_optimizer(model, cfg)
    steps(model, opt, 0)
    saver = async_checkpoint.AsyncSaver(pinned=False)  # a format-3 checkpoint, as the local engine writes
    checkpoint.start_save(tmp_path, 3, saver=saver, model=model, optimizer=opt, extra={}, keep=1,
                          scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))  # lr stays LR
    folder = checkpoint.finish_save(saver, tmp_path, model, opt)
    state, step = numerics.state_by_name(checkpoint.optimizer_state(folder), model.named_parameters(),
                                         {n: p.dtype for n, p in model.named_parameters()}, "fp32-master")
    assert step == 3 and all(("master" in v) == (dtype == "bfloat16") for v in state.values())
    masters = dict(getattr(opt, "nam_masters", []))
    for n, p in model.named_parameters():
        assert "master" not in state[n] or torch.equal(state[n]["master"], masters[p])

    again = _mlp(1, torch_dtype)
    again.load_state_dict(model.state_dict())  # the export's weights
    opt2 = make_optimizer(again, cfg)
    numerics.fill_state(opt2, again.named_parameters(), state, step=3)
    steps(model, opt, 3)
    steps(again, opt2, 3)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"missing \['0.bias'\]"):
        numerics.fill_state(make_optimizer(_mlp(2, torch_dtype), cfg), again.named_parameters(),
                            {n: v for n, v in state.items() if n != "0.bias"}, step=3)
    if dtype == "float32":
        with pytest.raises(ValueError, match=r"optimizer state of 0.weight: \['exp_avg', 'exp_avg_sq', 'master'\]"):
            numerics.fill_state(opt2, again.named_parameters(),
                                {**state, "0.weight": {**state["0.weight"], "master": state["0.weight"]["exp_avg"]}},
                                step=3)


def test_state_bytes_match_what_the_optimizer_allocates():
    """``STATE_BYTES`` (the memory plan's optimizer bytes per bf16 parameter) against the tensors each
    choice really holds after a step."""
    for name in numerics.NUMERICS:
        w = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
        opt = numerics.make_optimizer([w], numerics=name, **HP)
        w.grad = torch.ones_like(w)
        opt.step()
        state = opt.state_dict()
        held = sum(t.numel() * t.element_size() for s in state["state"].values() for k, t in s.items() if k != "step")
        held += sum(t.numel() * t.element_size() for t in state.get(numerics.MASTER_KEY, []))
        assert held == numerics.STATE_BYTES[name] * w.numel(), name


def test_a_missing_torchao_is_refused_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim raises ImportError
    w = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    for name in ("bf16-moments", "stochastic-rounding"):
        with pytest.raises(CannotRunHere, match="torchao") as info:
            numerics.make_optimizer([w], numerics=name, **HP)
        assert "pip install 'torchao==0.18.*'" in info.value.hint


def test_fp32_master_on_a_float32_model_updates_the_parameters_themselves():
    """No bf16 parameter, no master copy: the hooks have nothing to copy and the step is torch's AdamW's."""
    model, reference = _mlp(0, torch.float32), _mlp(0, torch.float32)
    opt = numerics.make_optimizer(model.parameters(), numerics="fp32-master", **HP)
    ref_opt = torch.optim.AdamW([{"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                lr=LR, betas=(0.9, 0.95), eps=1e-8)
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            _loss(m, step, cast=lambda p: p.bfloat16()).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    assert opt.nam_masters == [] and all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_float32_runs_take_fp32_master_only():
    from nam56r.run import RunRequest, resolve
    from nam_core.errors import ConfigError

    with pytest.raises(ConfigError, match="optimizer_numerics") as info:
        resolve(RunRequest(overrides=["train.optimizer_numerics=bf16"], env_plugins=False))
    assert "dtype=bfloat16" in str(info.value)
    with pytest.raises(ConfigError, match="expected one of fp32-master"):
        resolve(RunRequest(overrides=["train.optimizer_numerics=fp16"], env_plugins=False))


def test_a_resume_may_change_the_recompute_but_not_the_numerics():
    """``rundir.split_changes`` on two run records: recompute computes the same step (resumable), numerics change
    what the checkpoint's optimizer state holds (refused, with the old and new value for the message)."""
    import dataclasses

    from nam_core.engine.rundir import split_changes

    old = {"train": dataclasses.asdict(TrainConfig(dtype="bfloat16"))}
    new = {"train": dataclasses.asdict(TrainConfig(dtype="bfloat16", recompute=("mamba",),
                                                   optimizer_numerics="bf16-moments"))}
    allowed, refused = split_changes(old, new)
    assert allowed == {"train.recompute": [[], ["mamba"]]}
    assert refused == [("train.optimizer_numerics", "fp32-master", "bf16-moments")]
