"""Compile the mimo-scan's kernels for sm_90 without a GPU and report registers, spills and shared memory.

    python gpu/mimo_compile.py [KERNEL ...] [--warps 8] [--stages 1] [--maxnreg 128] [--ns 2] [--all-configs]

Runs the scan's forward and backward on small CPU tensors (b=2, l=256, NAM56R's widths: 128 heads of 64 in 8
groups, d_state 128, rank 4) with the launches recorded instead of run, then compiles each recorded kernel with
Triton for an sm_90 target (the arguments specialized as a GPU launch would: pointers and multiples of 16
marked divisible by 16) and runs ptxas -v on the PTX. Register pressure and spills do not depend on the length,
so this is how a kernel change is checked for spills between GPU rounds.

It needs the GPU host's Triton (3.6), whose wheel carries a ptxas for sm_90. Triton 3.9's wheel (this machine's
test venv) writes PTX 9.4, which neither its bundled ptxas (8.8) nor CUDA 13.0's accepts, so the rows come back as
ptxas's error. A venv that works here (2026-11-29; registers and shared memory matched r28's H200 launches)::

    python3 -m venv /tmp/t36 && . /tmp/t36/bin/activate
    pip install torch==2.13.0 triton==3.6.0 numpy tqdm packaging pyyaml pluggy typer
    pip install --no-deps -e . -e plugins/nam-plugin-mimo-scan
    python gpu/mimo_compile.py
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time


def record_launches():
    import torch

    from nam_plugin_mimo_scan import kernels, scan
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs

    launches = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((self.name, self.kernel, args, meta))
            return launch

    for name, kernel in list(kernels.KERNELS.items()):
        kernels.KERNELS[name] = Recorder(name, kernel)
    kernels.phase_kernel = Recorder("phase", kernels.phase_kernel)
    kernels.time_grads_kernel = Recorder("time_grads", kernels.time_grads_kernel)
    real_launch = scan._launch

    def launch(name, grid, *args, **meta):
        kernels.KERNELS[name][grid](*args, **meta)

    scan._launch = launch
    b, l, h, g = 2, 256, 128, 8
    x = random_inputs(b, l, h, g, 128, 64, 4, device="cpu", seed=1)
    leaves = {k: (t.to(torch.bfloat16) if k in ACTIVATIONS else t).requires_grad_() for k, t in x.items()}
    args = [leaves[k] if k != "angles" else leaves[k].expand(b, l, h, -1) for k in INPUT_NAMES]
    out = scan.mimo_scan(*args)
    torch.autograd.grad(out, list(leaves.values()), torch.randn_like(out))
    scan._launch = real_launch
    seen, unique = set(), []
    for name, kernel, a, meta in launches:
        flags = tuple(sorted((k, v) for k, v in meta.items() if isinstance(v, bool)))
        if (name, flags) not in seen:
            seen.add((name, flags))
            unique.append((name, kernel, a, meta))
    return unique


def compile_one(kernel, args, meta, warps, stages, maxnreg=None):
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel  # the JITFunction
    names = fn.arg_names
    meta = {k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")}
    signature, constexprs, attrs = {}, dict(meta), {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
            else:
                signature[name] = "i32" if abs(value) < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    for name in names[len(args):]:
        signature[name] = "constexpr"
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages,
                                                                       **({"maxnreg": maxnreg} if maxnreg else {})})


def ptxas_info(compiled, dump_to: str | None = None) -> str:
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    sass = "?"
    with tempfile.TemporaryDirectory() as tmp:  # the PTX and the cubin; nothing stays behind, whatever fails
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", cubin, ptx], capture_output=True, text=True)
        if os.path.exists(cubin):  # the code's size: instruction-cache misses showed in ncu's stall samples (r29)
            dump = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", cubin],
                                  capture_output=True, text=True).stdout
            sass = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", dump, re.M))
            # barriers and shuffles: what a cross-warp (intra-warp) reduction or layout change costs
            counts = {op: len(re.findall(pattern, dump)) for op, pattern in
                      (("BAR", r" BAR\."), ("SHFL", r" SHFL\."), ("STS", r" STS"))}
            sass = f"{sass} SASS instructions ({', '.join(f'{n} {op}' for op, n in counts.items())})"
            if dump_to:  # for gpu/ncu_lines.py: the same build, disassembled with its source lines (written whole
                # or not at all: a failed nvdisasm is reported on the row instead)
                dis = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-g", "-c", cubin],
                                     capture_output=True, text=True)
                if dis.returncode:
                    sass += f"; nvdisasm failed, nothing written: {dis.stderr.strip().splitlines()[:1]}"
                else:
                    with open(dump_to, "w") as f:
                        f.write(dis.stdout)
    text = done.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if done.returncode or not regs:
        return f"ptxas ({ptxas}) said: {text.strip().splitlines()[:2]}"
    return (f"regs {regs.group(1)}, spill stores {spill.group(1) if spill else '?'} B, "
            f"loads {spill.group(2) if spill else '?'} B, {sass}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernels", nargs="*")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--maxnreg", type=int, default=None, help="cap the registers a thread (Triton's maxnreg)")
    ap.add_argument("--ns", type=int, default=None, help="the bwd kernel's NS (dq / dk column windows)")
    ap.add_argument("--all-configs", action="store_true", help="every config of kernels.CONFIGS, not the first")
    ap.add_argument("--dump", default=None, metavar="DIR",
                    help="write each build's disassembly with source lines (nvdisasm -g) here, for gpu/ncu_lines.py")
    a = ap.parse_args()
    from nam_plugin_mimo_scan import kernels

    for name, kernel, args, meta in record_launches():
        if a.kernels and name not in a.kernels:
            continue
        configs = kernels.CONFIGS.get(name, [None])
        for config in configs if a.all_configs else configs[:1]:
            warps = a.warps or (config.num_warps if config else meta.get("num_warps", 4))
            stages = a.stages or (config.num_stages if config else meta.get("num_stages", 1))
            extra = dict(config.kwargs) if config else {}
            if a.ns and "NS" in extra and not meta.get("CHUNK"):
                extra["NS"] = a.ns
            t0 = time.time()
            maxnreg = a.maxnreg or (config.maxnreg if config else None)
            compiled = compile_one(kernel, args, {**meta, **extra}, warps, stages, maxnreg)
            flags = "".join(k for k, v in meta.items() if v is True)
            label = f"{name}[{flags}]" if flags else name
            dump_to = None
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                dump_to = os.path.join(a.dump, re.sub(r"[^A-Za-z0-9_]+", "_", f"{label}_w{warps}_s{stages}_{extra}")
                                       + ".sass")
            print(f"{label} warps={warps} stages={stages} maxnreg={maxnreg} {extra}: "
                  f"shared {compiled.metadata.shared} B, {ptxas_info(compiled, dump_to)} ({time.time() - t0:.0f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
