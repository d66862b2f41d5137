"""liger on the CPU: fail-closed activation, the patch lane on faked releases, the head's math.

Liger is Triton-only, so the math runs through two pure-torch stand-ins of its function: ``flce_fixed`` (what
liger-kernel >= 0.8.2 computes) and ``flce_issue968`` (gradients computed in forward and every row scaled by
``grad_output[0]`` in backward, as releases < 0.8.2 do). Installed releases are faked by replacing
``importlib.metadata.version`` for ``liger-kernel`` only. GPU parity with real Liger: test_liger_gpu.py.
"""

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from nam56r.reference.ce import ReferenceCEHead
from nam_cli.main import run
from nam_core.device import DeviceInfo
from nam_core.errors import NamError, PluginActivationError
from nam_core.host import PluginHost
from nam_core.patches import APPLIED, BUG_REPRODUCED, FIX_VALIDATED, NEEDED, NOT_INSTALLED, RETIRED, apply_all
from nam_core.registry import Entry
from nam_core.requirements import FAIL, PASS, SKIP
from nam_core.testing import fake_device, nan_in_gradient
from nam_plugin_liger import head, patch
from nam_plugin_liger.head import IGNORE_INDEX, MEAN_TIMES_LIVE, NONE_TIMES_MASK, LigerCEHead

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")
HINT = "pip install nam-plugin-liger[gpu]"


# --- fixtures: a faked liger-kernel release, a clean patch state -------------------------------------
@pytest.fixture
def liger_release(fake_versions):
    """``liger_release("0.8.1")`` makes liger-kernel look installed at 0.8.1; ``None``: not installed."""
    return lambda version: fake_versions(**{"liger-kernel": version})


@pytest.fixture(autouse=True)
def no_workaround():
    head.reset_workaround()
    yield
    head.reset_workaround()


def by_name(rows) -> dict:
    """Patch reports (or ``nam patches --json`` rows) by name, in their order."""
    return {(r["name"] if isinstance(r, dict) else r.name): r for r in rows}


# --- pure-torch stand-ins for Liger's function ---------------------------------------------------------
def flce_fixed(hidden, weight, target, reduction):
    """Liger's fused linear CE in plain autograd, fp64 logits (tiny sizes only); IGNORE_INDEX rows give 0."""
    logits = hidden.double() @ weight.double().T  # [t, v]
    per_token = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none")  # [t]
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    assert reduction == "mean", reduction
    return per_token.sum() / (target != IGNORE_INDEX).sum().clamp(min=1)  # Liger: 0 when all are ignored


class Issue968(torch.autograd.Function):
    """liger-kernel < 0.8.2: gradients computed in forward, then all scaled by ``grad_output[0]`` in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, reduction):
        with torch.enable_grad():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            loss = flce_fixed(h, w, target, reduction)
            dh, dw = torch.autograd.grad(loss.sum(), (h, w))  # per-row gradients, not yet scaled
        ctx.save_for_backward(dh, dw)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):
        dh, dw = ctx.saved_tensors
        first = grad_output.reshape(-1)[0]  # element_mul_kernel reads one scalar
        return dh * first, dw * first, None, None


def flce_issue968(hidden, weight, target, reduction):
    return Issue968.apply(hidden, weight, target, reduction)


def ce_inputs(t=48, d=16, v=40, seed=0, mask=None):
    """fp64 hidden [t, d], weight [v, d], target [t] with -1 placeholders where masked, 0/1 mask [t]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) * d**-0.5
    if mask is None:
        mask = (torch.rand(t, generator=g) > 0.3).to(torch.float64)
        mask[0] = 0.0  # token 0 masked: the case #968 turns into all-zero gradients
    target = torch.randint(0, v, (t,), generator=g)
    target = torch.where(mask != 0, target, -1)  # a placeholder a kernel must never read
    return hidden, weight, target, mask


def loss_and_grads(ce, hidden, weight, target, mask):
    """The model's LM loss ``ce(...) / sum(mask)`` and its gradients w.r.t. hidden and weight."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total = ce(h, w, target, mask)
    (total / mask.sum().clamp(min=1.0)).backward()
    return total.detach(), h.grad, w.grad


def assert_matches_reference(ce, *inputs):
    loss, dh, dw = loss_and_grads(ce, *inputs)
    loss_ref, dh_ref, dw_ref = loss_and_grads(ReferenceCEHead(), *inputs)  # fp64 reference
    assert loss.dtype == torch.float32
    # fp32 precision: the head returns an fp32 scalar, so the upstream gradient 1/sum(mask) is fp32 too.
    torch.testing.assert_close(loss.double(), loss_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-6, atol=1e-9)
    mask = inputs[3]
    assert torch.count_nonzero(dh[mask == 0]) == 0  # masked tokens: exactly zero gradient


# --- activation: fail closed, with what was needed, found, and the next command -----------------------
def test_activation_is_refused_on_the_cpu_profile(liger_release):
    liger_release("0.8.5")  # the package is there: only the device is wrong
    host = PluginHost()
    with pytest.raises(PluginActivationError) as e:
        host.activate(["liger"], CPU)
    assert {c.name: c.found for c in e.value.failures} == {
        "CUDA device": "no CUDA device (cpu (profile cpu))", "CUDA capability": "no CUDA device (cpu (profile cpu))",
    }
    assert "liger: CUDA device: needs a CUDA device, found no CUDA device" in e.value.message
    assert "run on a machine that has it" in e.value.hint and e.value.exit_code == 3
    assert "liger" not in host.registry("ce") and host.active == {}


def test_activation_without_liger_kernel_names_the_gpu_extra(liger_release):
    liger_release(None)
    with pytest.raises(PluginActivationError) as e:
        PluginHost().activate(["liger"], H100)
    [fail] = e.value.failures
    assert (fail.name, fail.needed, fail.found, fail.hint) == (
        "package liger-kernel", "liger-kernel>=0.8.0", "not installed", HINT)
    assert e.value.hint == HINT


def test_a_release_with_issue_968_activates_and_the_patch_lane_applies_the_workaround(liger_release):
    liger_release("0.8.1")
    host = PluginHost()
    host.activate(["liger"], H100)
    report = by_name(apply_all(host.registry("patches")))["liger-none-reduction-bwd"]
    assert report.state == APPLIED, report


def test_activation_needs_ampere_or_newer(liger_release, fake_a100):
    liger_release("0.8.5")
    assert PluginHost().evaluate(["liger"], fake_a100).ok  # sm_80: Triton's floor
    [fail] = PluginHost().evaluate(["liger"], fake_device("a100", capability=(7, 5))).failures  # a Turing part
    assert (fail.name, fail.needed, fail.found) == ("CUDA capability", ">= sm_80", "sm_75")


def test_activation_refuses_a_release_below_the_floor(liger_release):
    liger_release("0.7.9")
    [fail] = PluginHost().evaluate(["liger"], H100).failures
    assert fail.name == "package liger-kernel" and fail.found == "0.7.9" and fail.hint == HINT


def test_activates_on_an_h100_profile_with_0_8_5(liger_release):
    liger_release("0.8.5")
    host = PluginHost()
    ev = host.activate(["liger"], H100)
    assert host.registry("ce").get("liger") is LigerCEHead
    assert host.registry("ce").plugin_of("liger") == "liger"
    [launch] = [c for c in ev.checks if c.name == "launch checks"]
    assert launch.status == SKIP and launch.found == "profile h100"  # kernels never launch on a fake
    report = by_name(apply_all(host.registry("patches")))["liger-none-reduction-bwd"]
    assert report.state == RETIRED
    assert report.detail == "liger-kernel 0.8.5 is outside <0.8.2; fixed upstream"
    assert LigerCEHead().formulation == NONE_TIMES_MASK


# --- the patch lane -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version, state", [
    ("0.8.0", NEEDED), ("0.8.1", NEEDED), ("0.8.2", RETIRED), ("0.8.5", RETIRED), (None, NOT_INSTALLED),
])
def test_patch_state_follows_the_installed_release(liger_release, version, state):
    liger_release(version)
    p = patch.make_patch()
    assert p.state()[0] == state
    assert p.detect() == (state == NEEDED)


def test_patch_declares_its_reproducer_and_retirement():
    p = patch.make_patch()
    assert (p.name, p.target, p.versions) == ("liger-none-reduction-bwd", "liger-kernel", "<0.8.2")
    assert "0.8.2" in p.retire_when and "#1298" in p.retire_when
    assert p.needs_gpu and p.reproduce is patch.reproduce


def test_needed_patch_switches_the_head_to_mean_times_live(liger_release):
    liger_release("0.8.1")
    with pytest.raises(NamError, match="#968") as e:  # fail closed before the patch lane ran
        LigerCEHead(flce=flce_fixed).formulation
    assert HINT in e.value.hint and "nam patches --plugins liger" in e.value.hint
    entry = Entry("liger-none-reduction-bwd", patch.make_patch(), "liger")
    [report] = apply_all([entry])
    assert report.state == APPLIED and report.detail == "liger-kernel 0.8.1: fixed in-process"
    assert not entry.impl.detect()
    assert LigerCEHead(flce=flce_fixed).formulation == MEAN_TIMES_LIVE
    assert apply_all([entry])[0].state == RETIRED  # idempotent: the bug is gone from this process


def test_patches_command_shows_the_state_of_the_installed_release(liger_release, capsys):
    liger_release("0.8.1")
    assert run(["patches", "--plugins", "liger", "--json"]) == 0
    rows = by_name(json.loads(capsys.readouterr().out)["patches"])
    assert list(rows) == ["liger-peft-probe-import", "liger-none-reduction-bwd"]  # the order they apply in
    row = rows["liger-none-reduction-bwd"]
    assert (row["state"], row["versions"]) == (NEEDED, "<0.8.2")
    liger_release("0.8.5")
    assert run(["patches", "--plugins", "liger", "--json"]) == 0
    assert by_name(json.loads(capsys.readouterr().out)["patches"])["liger-none-reduction-bwd"]["state"] == RETIRED


# --- the head's math, through the stand-ins ---------------------------------------------------------
def test_none_times_mask_matches_the_reference():
    assert_matches_reference(LigerCEHead(NONE_TIMES_MASK, flce=flce_fixed), *ce_inputs())


def test_none_times_mask_takes_per_token_weights():
    g = torch.Generator().manual_seed(3)
    weights = torch.rand(48, generator=g, dtype=torch.float64).round(decimals=1)  # 0.0 .. 1.0, some zeros
    assert_matches_reference(LigerCEHead(NONE_TIMES_MASK, flce=flce_fixed), *ce_inputs(mask=weights))


@pytest.mark.parametrize("flce", [flce_fixed, flce_issue968], ids=["fixed", "issue968"])
def test_mean_times_live_matches_the_reference_even_on_an_affected_release(flce):
    assert_matches_reference(LigerCEHead(MEAN_TIMES_LIVE, flce=flce), *ce_inputs())
    assert_matches_reference(LigerCEHead(MEAN_TIMES_LIVE, flce=flce), *ce_inputs(seed=1, t=7, v=5))


def test_none_times_mask_is_wrong_on_an_affected_release():
    """Why the patch exists: token 0 masked -> every gradient scaled by 0."""
    inputs = ce_inputs()
    loss, dh, dw = loss_and_grads(LigerCEHead(NONE_TIMES_MASK, flce=flce_issue968), *inputs)
    loss_ref, dh_ref, _ = loss_and_grads(ReferenceCEHead(), *inputs)
    torch.testing.assert_close(loss.double(), loss_ref, rtol=1e-6, atol=0)  # the loss itself is right
    assert torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0 and dh_ref.abs().max() > 1e-3


def test_mean_times_live_with_no_live_token_gives_zero_not_nan():
    hidden, weight, target, _ = ce_inputs()
    mask = torch.zeros(48, dtype=torch.float64)
    loss, dh, dw = loss_and_grads(LigerCEHead(MEAN_TIMES_LIVE, flce=flce_issue968), hidden, weight,
                                  torch.full_like(target, -1), mask)
    assert loss.item() == 0.0 and torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0


def test_mean_times_live_refuses_a_weighted_mask():
    hidden, weight, target, mask = ce_inputs()
    with pytest.raises(ValueError, match="0/1 mask only"):
        LigerCEHead(MEAN_TIMES_LIVE, flce=flce_fixed)(hidden, weight, target, mask * 0.5)


def test_head_outside_cuda_or_without_liger_says_what_to_do(monkeypatch):
    hidden, weight, target, mask = ce_inputs()
    with pytest.raises(NamError, match="CUDA tensors") as e:
        LigerCEHead()(hidden, weight, target, mask)
    assert "--set ce_backend=reference" in e.value.hint
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # an import of it now fails, installed or not
    with pytest.raises(NamError, match="liger-kernel>=0.8.0") as e:
        head.liger_flce()
    assert e.value.hint == HINT


# --- the reproducer's judgement, on the CPU --------------------------------------------------------------
def test_reproducer_tells_the_bug_from_the_fix():
    bad = patch.run_reproducer(flce=flce_issue968, device="cpu", dtype=torch.float64)
    assert bad.verdict == BUG_REPRODUCED
    assert bad.errors["first-masked"] == pytest.approx(1.0)  # all-zero gradients: off by the whole gradient
    assert bad.errors["targets-kept"] > 0.1  # masked tokens got a live token's gradient
    good = patch.run_reproducer(flce=flce_fixed, device="cpu", dtype=torch.float64)
    assert good.verdict == FIX_VALIDATED and max(good.errors.values()) < 1e-12
    assert good.describe().startswith("FIX_VALIDATED")



def test_a_nan_gradient_never_validates_the_fix():
    """A gradient with a NaN is not the fixed release's gradient: the errors are inf, not NaN (``max`` skips a
    NaN that is not first, and ``nan > tolerance`` is false, which read as FIX_VALIDATED)."""
    broken = patch.run_reproducer(flce=lambda h, w, y, r: flce_fixed(nan_in_gradient(h), w, y, r), device="cpu",
                                  dtype=torch.float64)
    assert broken.verdict == BUG_REPRODUCED
    assert broken.errors == {"first-masked": float("inf"), "targets-kept": float("inf")}


def test_the_launch_comparison_reports_a_nan_gradient_as_inf(monkeypatch):
    """The preflight row's numbers (``smoke.compare_with_reference``) on the CPU, with a stand-in head whose dL/dW
    has one NaN: inf, so the row's ``max(errors) <= tolerance`` fails."""
    from nam_plugin_liger import smoke

    class NaNWeightGradHead(ReferenceCEHead):
        formulation = "stand-in"

        def __call__(self, hidden, weight, target, mask):
            return super().__call__(hidden, nan_in_gradient(weight), target, mask)

    monkeypatch.setattr(head, "LigerCEHead", NaNWeightGradHead)
    monkeypatch.setattr(head, "installed_version", lambda: "stand-in")
    errors, formulation, version = smoke.compare_with_reference(device="cpu")
    assert errors["dweight"] == float("inf") and errors["dhidden"] < 1e-2 and errors["loss"] < 1e-2, errors

# --- config check and preflight -----------------------------------------------------------------------
def test_the_host_wants_cuda_when_the_head_is_used_and_says_when_it_is_unused(liger_release):
    """liger declares ``train_device="cuda"``; the host writes the rows (the plugin has no config hook)."""
    from nam56r.run import spec_for

    liger_release("0.8.5")

    def rows(spec, device):
        return {c.name: c for c in PluginHost().evaluate(["reference", "liger"], device, spec).checks
                if c.plugin == "liger"}

    used = rows(spec_for("nam56r-tiny", "attention_backend=reference", plugins=["liger"], device="cuda"), H100)
    assert used["selected"].status == PASS and used["selected"].found == "ce_backend=liger"
    assert "train.device" not in used
    on_cpu = rows(spec_for("nam56r-tiny", plugins=["liger"]), H100)
    fail = on_cpu["train.device"]
    assert fail.status == FAIL and fail.found == "train.device=cpu" and "--device cuda" in fail.hint
    assert "--set ce_backend=reference" in fail.hint
    skip = rows(spec_for("nam56r-tiny", "ce_backend=reference", plugins=["liger"]), H100)["selected"]
    assert skip.status == SKIP and skip.hint == "--set ce_backend=liger"


@pytest.mark.parametrize("device", [H100, DeviceInfo(kind="cpu", name="cpu")], ids=["fake-h100", "real-cpu"])
def test_launch_check_is_not_run_without_a_real_gpu(device, liger_release):
    """The host skips the declared launch on a fake device (one skipped row) and never launches on a device whose
    requirements failed (the CPU): the check's function is not called."""
    liger_release("0.8.5")
    rows = {c.name: c for c in PluginHost().evaluate(["liger"], device).checks if c.plugin == "liger"}
    assert "fused CE launch" not in rows
    if device.is_fake:
        assert rows["launch checks"].status == SKIP
    else:
        assert rows["CUDA device"].status == FAIL and "launch checks" not in rows


def test_preflight_command_exits_3_on_the_cpu_profile(liger_release, capsys):
    liger_release("0.8.5")
    assert run(["preflight", "--plugins", "liger", "--device-profile", "cpu", "--json"]) == 3
    checks = {c["check"]: c["status"] for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["CUDA device"] == "fail" and checks["package liger-kernel"] == PASS
    assert checks["launch checks"] == SKIP


# --- liger-peft-probe-import: Liger's import without peft's ----------------------------------------------
UTILS_RELEASE = ("try:\n    import peft  # noqa\n\n    PEFT_AVAILABLE = True\nexcept ImportError:\n"
                 "    PEFT_AVAILABLE = False\n\nimport functools\n")
UTILS_LAZY = "import importlib.util\n\nPEFT_AVAILABLE = importlib.util.find_spec('peft') is not None\n"


@pytest.fixture
def fake_liger(tmp_path, monkeypatch):
    """``fake_liger(utils=UTILS_RELEASE, peft=True)``: a liger_kernel package whose fused CE module imports
    ``liger_kernel.utils`` (source ``utils``) and, with ``peft``, a peft package, first on sys.path; every module
    they imported is removed afterwards."""
    before = set(sys.modules)

    def make(utils: str = UTILS_RELEASE, peft: bool = True):
        root = tmp_path / ("with-peft" if peft else "without-peft")
        files = {"liger_kernel/__init__.py": "", "liger_kernel/utils.py": utils, "liger_kernel/ops/__init__.py": "",
                 "liger_kernel/ops/fused_linear_cross_entropy.py": "from liger_kernel.utils import PEFT_AVAILABLE\n"}
        if peft:
            files["peft/__init__.py"] = "import json  # stands for transformers and scikit-learn\nLOADED = True\n"
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        monkeypatch.syspath_prepend(str(root))
        return root

    yield make
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("liger_kernel", "peft"):
            del sys.modules[name]


def test_the_peft_probe_entry_imports_liger_without_peft_and_keeps_the_flag_true(liger_release, fake_liger):
    from nam_plugin_liger import peft_probe

    liger_release("0.8.5")
    fake_liger()
    assert peft_probe.make_patch().state()[0] == NEEDED
    assert peft_probe.apply_needed()
    utils = sys.modules["liger_kernel.utils"]
    assert "peft" not in sys.modules and utils.PEFT_AVAILABLE is True  # installed, not imported
    import peft  # the marker is gone: whoever uses peft imports it

    assert peft.LOADED and not peft_probe.apply_needed()  # done: nothing left to apply


def test_the_peft_probe_flag_is_false_where_peft_is_not_installed(liger_release, fake_liger):
    from nam_plugin_liger import peft_probe

    liger_release("0.8.5")
    fake_liger(peft=False)
    assert peft_probe.make_patch().state()[0] == RETIRED  # nothing to save: the probe fails at once
    peft_probe.apply()
    assert sys.modules["liger_kernel.utils"].PEFT_AVAILABLE is False


def test_a_liger_whose_utils_does_not_import_peft_retires_the_entry(liger_release, fake_liger):
    from nam_plugin_liger import peft_probe

    liger_release("0.8.5")
    root = fake_liger(utils=UTILS_LAZY)
    assert not peft_probe.imports_peft_at_import(root / "liger_kernel" / "utils.py")
    assert peft_probe.make_patch().state()[0] == RETIRED


def test_the_peft_probe_revert_imports_peft_as_the_unpatched_module_would(liger_release, fake_liger):
    from nam_core.patches import applied

    from nam_plugin_liger import peft_probe

    liger_release("0.8.5")
    fake_liger()
    with applied([Entry(peft_probe.NAME, peft_probe.make_patch(), "liger")]):
        assert "peft" not in sys.modules and peft_probe.applied()
    assert "peft" in sys.modules and sys.modules["liger_kernel.utils"].PEFT_AVAILABLE is True
    assert not peft_probe.applied()


def test_the_peft_probe_reproducer_tells_the_bug_from_the_fix(liger_release, fake_liger):
    from nam_plugin_liger import peft_probe

    liger_release("0.8.5")
    fake_liger()
    assert peft_probe.reproduce() == BUG_REPRODUCED
    peft_probe.apply()
    assert peft_probe.reproduce() == FIX_VALIDATED


@pytest.mark.parametrize("forward, said", [
    ("def forward(ctx, _input, weight, target, chunk_mem_const=1): ...", "chunk_mem_const=4: 1024-token chunks"),
    ("def forward(ctx, _input, weight, target): ...", "256-token chunks: this release takes no chunk_mem_const"),
])
def test_the_launch_row_says_how_the_installed_release_chunks_the_head(fake_liger, forward, said):
    """Releases before 0.8.3 take no chunk_mem_const and run NAM56R's head in 256-token chunks (~117 ms against
    ~64): that is said in the preflight launch row's text, not taken silently."""
    root = fake_liger()
    (root / "liger_kernel" / "ops" / "fused_linear_cross_entropy.py").write_text(
        f"class LigerFusedLinearCrossEntropyFunction:\n    @staticmethod\n    {forward}\n")
    assert head.chunking().startswith(said)


def test_hidden_and_weight_of_two_dtypes_are_refused_not_cast():
    """Liger's matmul takes one dtype; fp32 hidden against a bf16 weight was cast down to bf16 without a word."""
    hidden, weight, target, mask = ce_inputs()
    with pytest.raises(NamError, match=r"one dtype; found torch.float64 and torch.float32") as err:
        LigerCEHead(NONE_TIMES_MASK, flce=flce_fixed)(hidden, weight.float(), target, mask)
    assert err.value.hint.startswith("--set train.dtype=bfloat16")
