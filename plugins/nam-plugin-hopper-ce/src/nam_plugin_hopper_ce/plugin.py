"""Entry point of the hopper-ce plugin: what it declares and the hooks it implements.

Requesting the plugin selects ``ce_backend=hopper-ce`` (an explicit ``--set ce_backend=...`` wins). The host
checks its requirements and, when the head is used, ``train.device``/``train.dtype``. It proves itself before a
run uses it: on a real GPU, activation runs ``selftest.compare`` (three heads sharing one weight, masked bf16
tokens, against the reference head) and refuses to activate if any gradient is off, a masked token gets a
gradient, or anything is not finite (a self-test that raises is a failed check, with the exception).

This module stays light (no torch, no triton at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.requirements import FAIL, PASS

NAME = "hopper-ce"
GPU_HINT = "pip install 'nam-plugin-hopper-ce[gpu]'"
REFERENCE_HINT = "or the reference head: --set ce_backend=reference"

PLUGIN = PluginInfo(
    summary="hopper-ce: LM + MTP heads as chunked fused linear CE on Hopper (fp32 logits from cuBLAS, fp32 dW, "
            "Triton row kernels); gradient self-test at activation",
    provides={"ce": [NAME]},
    requires=(
        Requirement.cuda_capability((9, 0), reason="built and measured for Hopper (sm_90): cuBLAS bf16 GEMMs with "
                                                   "fp32 output, Triton row kernels"),
        Requirement.package("triton>=3.3", install_hint=GPU_HINT),
    ),
    selects={"ce_backend": NAME},
    train_device="cuda", train_dtypes=("bfloat16", "float16"),
    train_needs_reason="CUDA kernels whose GEMMs take 16-bit inputs",
)


@hookimpl
def nam_preflight(device, config):
    """The activation self-test, on a real CUDA device (the host skips launch checks on fakes and CPUs)."""
    from nam_plugin_hopper_ce import selftest
    from nam_plugin_hopper_ce.head import HopperCEHead

    needed = (f"loss, every dL/dhidden and the shared dL/dW within {selftest.TOLERANCE:g} of the reference head, "
              "0 on masked tokens, all finite (3 heads sharing one weight, bf16)")
    r = selftest.compare(HopperCEHead(chunk_tokens=128), device="cuda")
    ok = selftest.passed(r)
    found = (f"loss {r['loss']:.1e}, dhidden {r['dhidden']:.1e}, dweight {r['dweight']:.1e}, masked dh "
             f"{r['masked_dh']:g} (300 tokens x 256 x vocab 1000, chunks of 128; seed {r['seed']})")
    return [Check(NAME, "gradient self-test", PASS if ok else FAIL, needed, found,
                  hint=None if ok else f"report it with the seed; meanwhile {REFERENCE_HINT}")]


@hookimpl
def nam_register_ce_backends(register):
    from nam_plugin_hopper_ce.head import HopperCEHead

    register(NAME, HopperCEHead)
