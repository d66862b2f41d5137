"""Round 16's IM step: nam's mamba-ssm patch lane on the real mamba-ssm (the package's import deferred), then the
MIMO module's import, what it brought in and how long it took; the patch's reproducer with and without the
deferral; the undeferred import in a fresh interpreter for comparison."""

import subprocess
import sys
import time

from nam_plugin_mamba_ssm import patches, upstream

print("lane:", patches.apply_needed())
start = time.perf_counter()
upstream.load(upstream.MIMO_MODULE)
took = time.perf_counter() - start
print(f"MIMO module imported in {took:.2f} s; package deferred: {upstream.package_deferred()}; transformers "
      f"imported: {'transformers' in sys.modules}; Mamba2 module imported: {'mamba_ssm.modules.mamba2' in sys.modules}")
print("reproducer, this process deferring:", patches.reproduce_lazy())
upstream.run_package_init()
print("reproducer, this process not deferring:", patches.reproduce_lazy())
code = (f"import sys, time; sys.path[:0] = {sys.path!r}; from nam_plugin_mamba_ssm import upstream; "
        f"upstream.install_shim(); t = time.perf_counter(); import {upstream.MIMO_MODULE}; "
        "print(f'undeferred MIMO import in a fresh interpreter: {time.perf_counter() - t:.2f} s')")
subprocess.run([sys.executable, "-c", code], check=True)

# Liger's import with peft blocked (patch liger-peft-probe-import), in a fresh interpreter each way.
from nam_plugin_liger import peft_probe  # noqa: E402

print("liger-peft-probe-import:", peft_probe.make_patch().state())
for fixed in (False, True):
    code = (f"import sys, time; sys.path[:0] = {sys.path!r}; from nam_plugin_liger import peft_probe; "
            f"t = time.perf_counter(); {'peft_probe.apply(); ' if fixed else ''}"
            f"import {peft_probe.FLCE_MODULE}; import liger_kernel.utils as u; "
            "print(f'liger fused CE imported in {time.perf_counter() - t:.2f} s, " + ("with" if fixed else "without")
            + " the fix: peft imported {\"peft\" in sys.modules}, transformers imported {\"transformers\" in "
            "sys.modules}, PEFT_AVAILABLE {u.PEFT_AVAILABLE}')")
    subprocess.run([sys.executable, "-c", code], check=True)
peft_probe.apply()
print("liger-peft-probe-import reproducer with the fix:", peft_probe.reproduce())
