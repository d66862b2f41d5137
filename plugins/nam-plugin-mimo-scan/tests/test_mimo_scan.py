"""nam-plugin-mimo-scan on CPU: the Triton kernels under Triton's interpreter against the reference (output and
every input gradient, each checked by name), registration, selection, and activation and
config refusals. bf16 parity at NAM56R's widths, host syncs and CUDA-graph capture are in
test_mimo_scan_gpu.py."""

from __future__ import annotations

import pytest

import nam_plugin_mimo_scan.plugin as plugin
from nam_core.device import DeviceInfo
from nam_core.errors import PluginActivationError
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP
from nam_core.testing import fake_device

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")
GB10 = DeviceInfo.profile("gb10")
FP32_TOLERANCE = 1e-4  # selftest.TOLERANCE[float32]: fp32 inputs, only summation order differs (measured ~5e-7)
GRADS = ("dq", "dk", "dv", "dadt", "ddt", "dtrap", "dq_bias", "dk_bias", "dangles", "dd", "dz", "dmimo_x",
         "dmimo_z", "dmimo_o")

# --- the Triton kernels under the interpreter -------------------------------------------------------
# fp32 inputs: Triton's CPU interpreter gets bf16 wrong (see nam-plugin-sparse-mla's README), so bf16 runs on
# the GPU host only. l=37 is no multiple of any tile; 8-token tiles give 5 chunks (4 state hand-overs).
INTERPRETED = """
import json, torch
import nam_plugin_mimo_scan.scan as scan
from nam_plugin_mimo_scan.selftest import compare
scan.TIME_BLOCK = 16  # the walks along the sequence (phase, reverse sums) take 3 blocks of l=37, the last ragged
f32 = dict(device="cpu", dtype=torch.float32)
cases = {
    # rank 2, one group for all 4 heads (the dq/dk head loop sums 4 heads), 8-token tiles of 16 rows
    "r2_g1": compare(2, 37, 4, 1, 32, 16, 2, block_t=8, **f32),
    # rank 3: padded to 4 rows per token, the padded rank masked; 2 heads per group
    "r3_g2": compare(2, 37, 4, 2, 32, 16, 3, block_t=8, **f32),
    # rank 4, a group per head; the default tile (16 tokens: 3 chunks, the last ragged); headdim 32: the
    # per-head backward pass walks it in 2 column blocks
    "r4_g4": compare(1, 37, 4, 4, 32, 32, 4, **f32),
}
# dq and dk in column windows (config NS 2: each program a window of 16 of each half's 32 columns), which load the
# group's q and k once and the next head's phase table ahead; the per-head pass whole; 2 heads per group; 8-token
# tiles (5 chunks, the last ragged: the dstate walk loads each next chunk's table ahead)
from nam_plugin_mimo_scan import kernels
kernels.CONFIGS["bwd"] = [kernels._config(4, NS=2), kernels._config(4, 2, NS=1)]
kernels.KERNELS["bwd"] = kernels._tuned("bwd", kernels.bwd_kernel)
cases["r4_g2_windows"] = compare(1, 37, 4, 2, 64, 16, 4, block_t=8, **f32)
print(json.dumps(cases))
"""


@pytest.fixture(scope="module")
def interpreted(run_interpreted):
    return run_interpreted(INTERPRETED)


@pytest.mark.parametrize("case", ["r2_g1", "r3_g2", "r4_g4", "r4_g2_windows"])
def test_kernels_match_the_reference_in_output_and_every_gradient(interpreted, case):
    errors = dict(interpreted[case])
    seed = errors.pop("seed")
    print(case, seed, errors)
    assert set(errors) == {"out", *GRADS}
    bad = {k: v for k, v in errors.items() if not v < FP32_TOLERANCE}  # NaN fails here too
    assert not bad, f"{case} seed {seed}: over {FP32_TOLERANCE}: {bad}"


WRONG_GRADIENT = """
import functools, json, torch
import nam_plugin_mimo_scan.scan as scan
from nam_plugin_mimo_scan.selftest import compare
# drop the reverse sums along the sequence: d adt and d angles must go wrong
scan._time_grads = functools.partial(scan._time_grads, cumulative=False)
print(json.dumps(compare(1, 20, 2, 1, 32, 16, 2, block_t=8, device="cpu", dtype=torch.float32, seed=3)))
"""


def test_the_parity_check_catches_a_wrong_gradient(run_interpreted):
    """The harness can fail: with the reverse sums along the sequence removed, exactly d adt and d angles are
    off."""
    errors = run_interpreted(WRONG_GRADIENT)
    errors.pop("seed")
    assert {k for k, v in errors.items() if v > 0.1} == {"dadt", "dangles"}, errors


KEPT_STATES = """
import json, torch
import nam_plugin_mimo_scan.scan as scan
from nam56r.recompute import checkpointed
from nam_plugin_mimo_scan.selftest import INPUT_NAMES, random_inputs
launches = []
launch, phase = scan._launch, scan._phase_and_decay
def counted(name, *a, **kw):
    launches.append(name)
    return launch(name, *a, **kw)
def counted_phase(*a, **kw):
    launches.append("phase")
    return phase(*a, **kw)
scan._launch, scan._phase_and_decay = counted, counted_phase
b, l, h = 1, 20, 2  # 8-token tiles: 3 chunks, the last ragged; the dq / dk loop sums the group's 2 heads
x = random_inputs(b, l, h, 1, 32, 16, 4, device="cpu", seed=11, dtype=torch.float32)
dout = torch.randn(b, l, h, 16, generator=torch.Generator().manual_seed(12))
backend = scan.MimoScan()
def run(how):
    leaves = {k: t.clone().requires_grad_() for k, t in x.items()}
    args = [leaves[k].expand(b, l, h, -1) if k == "angles" else leaves[k] for k in INPUT_NAMES]
    launches.clear()
    if how == "kept":
        out = scan.mimo_scan(*args, block_t=8, keep_states=True)
    elif how == "plain":
        out = scan.mimo_scan(*args, block_t=8)
    else:  # nam's checkpoint; "replay": as the Mamba-3 mixer under train.recompute=mamba-scan
        passes = []
        def between(*a):
            passes.append(None)
            fn = backend if how == "checkpointed" or len(passes) == 1 else backend.for_backward_only
            return fn(*a[:-1], chunk_size=8)
        out = checkpointed(between, None, *args)
    forward = list(launches)
    out.backward(dout)
    grads = [out.detach()] + [leaves[k].grad for k in INPUT_NAMES]
    backward = launches[len(forward):]
    return grads, {name: [forward.count(name), backward.count(name)] for name in ("phase", "state_walk", "fwd_chunk")}
scan.TILE_ROWS = 32  # 8-token tiles at rank 4, as block_t=8 (the backend takes the default tile)
ref, plain = run("plain")
result = {"plain": plain}
for how in ("kept", "checkpointed", "replay"):
    grads, counts = run(how)
    result[how] = {**counts, "same": all(torch.equal(a, r) for a, r in zip(grads, ref))}
print(json.dumps(result))
"""


def test_states_kept_from_the_forward_spare_the_backward_its_walks_with_the_same_bits(run_interpreted):
    """``keep_states=True``, and nam's activation checkpoint (whose replay rebuilds what the forward saves),
    hand the forward's chunk states and phase table to the backward, which then runs neither the state walk
    nor the phase kernel; the replay of ``train.recompute=mamba-scan`` (``for_backward_only``) also skips
    ``fwd_chunk``. The output and every gradient are bit-identical to a plain call's. Counts are [forward,
    backward] launches; a checkpoint's replay runs in the backward."""
    runs = run_interpreted(KEPT_STATES)
    walk_again = {"phase": [1, 1], "state_walk": [1, 1], "fwd_chunk": [1, 0]}
    assert runs["plain"] == walk_again  # without a checkpoint the backward walks again by default
    assert runs["kept"] == {"phase": [1, 0], "state_walk": [1, 0], "fwd_chunk": [1, 0], "same": True}
    assert runs["checkpointed"] == {**walk_again, "fwd_chunk": [1, 1], "same": True}  # the replay's forward
    assert runs["replay"] == {**walk_again, "same": True}  # the replay: phase and walk, no fwd_chunk


# --- registration ------------------------------------------------------------------------------
def test_the_scan_satisfies_the_protocol_and_refuses_siso():
    import torch

    from nam56r.backends import SSMScan
    from nam_plugin_mimo_scan.scan import MimoScan, mimo_scan

    assert isinstance(MimoScan(), SSMScan)
    q = torch.zeros(1, 4, 1, 1, 32)
    v = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="MIMO only"):
        mimo_scan(q, q, v, None, None, None, None, None, torch.zeros(1, 4, 2, 8), None, v, None, None, None)


def test_shapes_past_the_kernels_32_bit_offsets_are_refused_before_any_launch():
    """The kernels' offsets are 32-bit: at NAM56R's widths and l=4096 the states buffer of 8 sequences holds
    exactly 2**31 elements (the last offset fits), 9 would wrap. Shapes only (meta tensors): nothing is
    allocated or launched."""
    import torch

    from nam_plugin_mimo_scan.scan import index_problem, mimo_scan

    def shapes(b, l=4096):  # NAM56R's widths: 128 heads of 64, rank 4, d_state 128, 32 angles
        return b, l, 128, 4, 128, 64, 32

    assert index_problem(*shapes(8)) is None
    problem = index_problem(*shapes(9))
    assert "states" in problem and "2,415,919,104 elements" in problem and "micro_batch_size=8" in problem
    assert "even for one sequence" in index_problem(*shapes(1, l=4096 * 9))
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, v, angles = (torch.empty(9, 4096, 4, 8, 128, **meta), torch.empty(9, 4096, 128, 64, **meta),
                    torch.empty(9, 4096, 128, 32, **meta))
    mimo_x = torch.empty(128, 4, 64, device="meta")
    with pytest.raises(ValueError, match="32-bit offsets"):
        mimo_scan(q, q, v, None, None, None, None, None, angles, None, v, mimo_x, mimo_x, mimo_x)


# --- activation and config: fail closed ----------------------------------------------------------------
def recipe(*overrides, base="nam56r", device="cuda"):
    """The RunSpec of `--plugins mimo-scan --set ssm_backend=mimo-scan` on ``base`` (the nam56r recipes request
    mamba-ssm, which selects the same field: the explicit --set settles it), every other kind on the reference."""
    from nam56r.run import spec_for

    others = ("ssm_backend=mimo-scan", "attention_backend=reference", "indexer_kernels_backend=reference",
              "ce_backend=reference", "moe_backend=reference")
    return spec_for(base, *others, *overrides, plugins=["mimo-scan"], device=device).replace(
        plugins=("reference", "mimo-scan"))


def checks_of(spec, device=H100):
    """The mimo-scan rows of the host's evaluation (requirements, the host's rows, the plugin's config check)."""
    return {c.name: c for c in PluginHost().evaluate(spec.plugins, device, spec).checks if c.plugin == "mimo-scan"}


def failures(device, config=None):
    ev = PluginHost().evaluate(["mimo-scan"], device, config)
    return {c.name: c for c in ev.failures if c.plugin == "mimo-scan"}


def test_activates_on_an_h100_profile_and_registers_the_scan():
    from nam_plugin_mimo_scan.scan import MimoScan

    host = PluginHost()
    host.activate(recipe().plugins, H100, recipe())
    assert host.registry("ssm").get("mimo-scan") is MimoScan


def test_activation_is_refused_on_the_cpu_profile():
    bad = failures(CPU)
    assert set(bad) == {"CUDA capability", "shared memory per block"}
    assert bad["CUDA capability"].found.startswith("no CUDA device")
    with pytest.raises(PluginActivationError, match="mimo-scan: CUDA capability"):
        PluginHost().activate(["mimo-scan"], CPU)


def test_activation_is_refused_before_hopper(fake_a100):
    bad = failures(fake_a100)
    assert set(bad) == {"CUDA capability"} and bad["CUDA capability"].found == "sm_80"


@pytest.mark.parametrize("triton, found", [(None, "not installed"), ("3.4.0", "3.4.0")])
def test_activation_without_a_triton_it_can_run_names_the_gpu_extra(fake_versions, triton, found):
    fake_versions(triton=triton)
    bad = failures(H100)
    assert set(bad) == {"package triton"}
    assert bad["package triton"].found == found and bad["package triton"].hint == plugin.GPU_HINT


def test_gb10_shared_memory_is_enough():
    """sm_121 offers 101,376 B per block; the largest kernel's measured need is below it."""
    assert plugin.SMEM_BYTES <= 101_376
    assert "shared memory per block" not in failures(GB10)


def test_the_tuner_offers_each_pass_only_the_launch_configs_measured_correct_and_every_walk_config():
    """On an H200 the per-head backward pass returned non-finite gradients at 8 warps with 1 stage (32-token tiles,
    r31 and r32) and reads out of range at 4 warps with 1 stage (r63), and r30 faulted in the one round that
    offered dq / dk 4 warps with 2 stages. 3 stages were checked for dq only, at 64-row tiles (at 128 rows it needs
    more shared memory than an SM has). The rule that keeps those out must not reach the walks: r32's first
    version dropped their 2-stage configs."""
    from nam_plugin_mimo_scan import kernels

    shape = dict(P=64, T=16, RP=4, HALF=64)

    def offered(name, **flags):
        return {(c.num_warps, c.num_stages, c.kwargs.get("PSPLIT")) for c in
                kernels._fits(kernels.CONFIGS[name], {}, **shape, **flags)}

    per_head = {(c.num_warps, c.num_stages, c.maxnreg) for c in
                kernels._fits(kernels.CONFIGS["bwd"], {}, **shape, CHUNK=True, DQ=False, DK=False)}
    assert per_head == kernels.PER_HEAD_CONFIGS
    assert (8, 1, None) not in per_head and (4, 1, None) not in per_head
    for flags in (dict(DQ=True, DK=False), dict(DQ=False, DK=True)):
        windows = {(c.num_warps, c.num_stages, c.kwargs["NS"]) for c in
                   kernels._fits(kernels.CONFIGS["bwd"], {}, **shape, CHUNK=False, **flags)}
        assert (4, 2, 1) not in windows
        assert {(4, 1, 1), (4, 2, 2)} <= windows
        assert ((4, 3, 2) in windows) == flags["DQ"]  # dq only
    wide = dict(shape, T=32)  # 32-token tiles: 128 rows
    dq_wide = {(c.num_warps, c.num_stages, c.kwargs["NS"]) for c in
               kernels._fits(kernels.CONFIGS["bwd"], {}, **wide, CHUNK=False, DQ=True, DK=False)}
    assert (4, 2, 2) in dq_wide and not any(st > 2 for _, st, _ in dq_wide)
    for walk in ("state_walk", "dstate_walk"):
        assert offered(walk) == {(c.num_warps, c.num_stages, c.kwargs["PSPLIT"]) for c in kernels.CONFIGS[walk]}
        assert any(c.num_stages == 2 for c in kernels.CONFIGS[walk])


def test_requesting_the_plugin_selects_the_scan_and_an_explicit_choice_wins():
    from nam56r.run import spec_for

    assert spec_for("nam56r-tiny", plugins=["mimo-scan"], device="cuda").model.ssm_backend == "mimo-scan"
    rec = recipe("ssm_backend=reference")
    assert rec.model.ssm_backend == "reference"
    assert checks_of(rec)["selected"].status == SKIP and "active but unused" in checks_of(rec)["selected"].found
    assert "kernel shapes" not in checks_of(rec)  # an unused plugin's config check is not asked


def test_config_check_passes_nam56r():
    checks = checks_of(recipe())
    assert checks["kernel shapes"].status == PASS
    assert checks["kernel shapes"].found == "d_state 128, headdim 64, rank 4, ngroups 8"
    assert not [c for c in checks.values() if c.status == FAIL]


@pytest.mark.parametrize("overrides, fragment, hint", [
    (("mamba_mimo_rank=1",), "rank 1 (SISO): this backend runs MIMO only", "--set ssm_backend=mamba-ssm"),
    (("d_state=96",), "d_state 96 is not a power of two in [32, 256]", "NAM56R's widths"),
    # hidden 3072: 6144 / 48 = 128 heads in 8 groups, a model nam builds (48 does not divide NAM56R's 8192)
    (("hidden=3072", "mamba_headdim=48"), "headdim 48 is not a power of two in [16, 128]", "NAM56R's widths"),
])
def test_config_check_refuses_widths_the_kernels_cannot_take(overrides, fragment, hint):
    check = checks_of(recipe(*overrides))["kernel shapes"]
    assert check.status == FAIL and fragment in check.found, check.found
    assert hint in check.hint


def test_config_check_refuses_a_micro_batch_past_the_kernels_32_bit_offsets():
    assert checks_of(recipe("train.micro_batch_size=8"))["index range"].status == PASS
    check = checks_of(recipe("train.micro_batch_size=9"))["index range"]
    assert check.status == FAIL and check.found.startswith("micro-batch 9 x 4096 tokens: ")
    assert "--set train.micro_batch_size=8" in check.found, check.found


def test_the_host_wants_cuda_and_bf16_from_the_declaration():
    checks = checks_of(recipe("train.dtype=float32", device="cpu"))
    assert checks["train.device"].status == FAIL and checks["train.device"].found == "train.device=cpu"
    assert checks["train.dtype"].status == FAIL and checks["train.dtype"].found == "train.dtype=float32"


def test_preflight_launch_is_not_attempted_on_a_config_it_refuses():
    real = fake_device("h100", profile_name=None)  # the host takes it for a real GPU: its launch checks run
    rows = checks_of(recipe("mamba_mimo_rank=1").replace(device=real), real)
    assert rows["kernel shapes"].status == FAIL
    assert "kernel launch" not in rows and "launch check" not in rows  # a launch here would raise on the CPU
