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
