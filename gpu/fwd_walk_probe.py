"""Probe (2026-12-07, not a shipped kernel): the mimo-scan forward as one walk per (b, h), the output of each
chunk computed where the state walk reaches it (S_in from the fp32 carry in registers, rounded as the stored
states are; ``STORE`` also writes S_in for the backward), in place of ``state_walk`` + ``fwd_chunk``.

    TRITON_INTERPRET=1 python gpu/fwd_walk_probe.py interp   # fp32 on the CPU: the same bits as the split forward
    python gpu/fwd_walk_probe.py compile                     # sm_90 registers / spills (the Triton 3.6 venv of
                                                             # gpu/mimo_compile.py), beside the shipped two kernels
    python gpu/fwd_walk_probe.py time                        # on the GPU host: its time against the two kernels'

Result (2026-12-07): the interpreter gives the split forward's output and S_in bit for bit (b1 l37 h4 g2 n32 p32
r4, whole and split in two along p). Offline on sm_90 the walk takes 255 registers at 8 warps (12 B of spills; 36 B
with ``STORE``), so one program an SM, and NAM56R's b2 has 256 programs: two waves of 256 steps each. Capped at 128
registers (two an SM, one wave) it spills 768 B; at 4 warps 532 B uncapped, 1,492 B at 168. One wave would have to
take under ~12 us a step to beat state_walk + fwd_chunk (3.07 ms on the H100, r66), where the state walk's own
step, a third of this work, takes ~4.3 us.

``PS`` (2026-12-07, later) splits the head dim over PS programs a (b, h) (grid ``(b*h, PS)``), as the
state walk's PSPLIT does: each carries ``[p / PS, n]`` of the state and writes its columns of the output; q~k~^T
and the decay weights are formed by each of them. Offline: PS 2 at 4 warps 255 registers, 136 B of spills (two
programs an SM; 512 programs at b2); at 8 warps 244 registers, none; PS 4 at 4 warps 255 / 68 B, at 8 warps 244 /
none. Under the interpreter at p 64, n 128, PS 2 gives the same bits too (PS 4: within 3e-5 in fp32).

Measured (2026-12-07, gpu/r70.sh, one H100, b2, bf16; bench/README "Nineteenth session"): the split pair 3.064 ms;
the walk at 8 warps 3.264 (0.94x), capped at 128 registers 6.557, at 4 warps 3.003 (1.02x), storing S_in at 8
warps 3.400 (0.90x), every output bit-identical; PS 2 at 4 warps faulted (illegal address; not root-caused), so
the PS rows after it did not run. Level at best: not built.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch, triton
import triton.language as tl
from nam_plugin_mimo_scan import kernels as K, scan
from nam_plugin_mimo_scan.kernels import (_rows, _cos_sin, _rotated, _decay_weights, _load_rows, _load_proj, _sigmoid)


@triton.jit
def fwd_walk_kernel(q_ptr, k_ptr, qb_ptr, kb_ptr, rot_ptr, x_ptr, z_ptr, mx_ptr, mz_ptr, mo_ptr, d_ptr,
                    cs_ptr, gam_ptr, c_ptr, s_ptr, out_ptr,
                    L, H, HPG, R, S, NC, q_sb, q_sl, q_sr, q_sg, k_sb, k_sl, k_sr, k_sg,
                    x_sb, x_sl, x_sh, z_sb, z_sl, z_sh, o_sb, o_sl, o_sh,
                    T: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr, STORE: tl.constexpr,
                    PS: tl.constexpr = 1):
    bh = tl.program_id(0)
    PW: tl.constexpr = P // PS  # PS programs a (b, h), each P / PS of the head dim (grid (b*h, PS))
    b = bh // H
    h = bh % H
    g = h // HPG
    LP = NC * T
    DT = q_ptr.dtype.element_ty
    pcols = tl.program_id(1) * PW + tl.arange(0, PW)
    hcols = tl.arange(0, HALF)
    rot_base = (b * L * H + h) * 2 * S
    carry_lo = tl.zeros((PW, HALF), tl.float32)
    carry_hi = tl.zeros((PW, HALF), tl.float32)
    dskip = tl.load(d_ptr + h)
    for c in range(NC):
        tok, rank, valid = _rows(c, L, R, T, RP)
        cos, sin = _cos_sin(rot_ptr, c, L, rot_base, H * 2 * S, S, 0, T, RP, HALF)
        qlo, qhi = _rotated(q_ptr, qb_ptr, tok, rank, valid, b * q_sb + g * q_sg, q_sl, q_sr, h * R * 2 * HALF,
                            cos, sin, 0, HALF, HALF)
        klo, khi = _rotated(k_ptr, kb_ptr, tok, rank, valid, b * k_sb + g * k_sg, k_sl, k_sr, h * R * 2 * HALF,
                            cos, sin, 0, HALF, HALF)
        qlo = qlo.to(DT)
        qhi = qhi.to(DT)
        klo = klo.to(DT)
        khi = khi.to(DT)
        cs = tl.load(cs_ptr + bh * LP + tok)
        cs_end = tl.load(cs_ptr + bh * LP + c * T + T - 1)
        cc = tl.load(c_ptr + bh * LP + tok)
        amat, _ = _decay_weights(tok, cs, tl.load(gam_ptr + bh * LP + tok), cc, T, RP)
        qk = tl.dot(qlo, tl.trans(klo)) + tl.dot(qhi, tl.trans(khi))
        v = (_load_rows(x_ptr, b * x_sb + h * x_sh, tok, x_sl, valid, pcols)
             * _load_proj(mx_ptr, h, rank, valid, R, P, pcols))
        y = tl.dot((qk * amat).to(DT), v.to(DT))
        s_lo = carry_lo.to(DT)
        s_hi = carry_hi.to(DT)
        if STORE:
            sp = s_ptr + ((bh * NC + c) * P + pcols[:, None]) * (2 * HALF) + hcols[None, :]
            tl.store(sp, s_lo)
            tl.store(sp + HALF, s_hi)
        y += tl.exp(cs)[:, None] * (tl.dot(qlo, tl.trans(s_lo)) + tl.dot(qhi, tl.trans(s_hi)))
        zm = _load_rows(z_ptr, b * z_sb + h * z_sh, tok, z_sl, valid, pcols) * _load_proj(mz_ptr, h, rank, valid, R,
                                                                                           P, pcols)
        o = (y + dskip * v) * zm * _sigmoid(zm) * _load_proj(mo_ptr, h, rank, valid, R, P, pcols)
        out = tl.sum(tl.reshape(o, (T, RP, PW)), axis=1)
        toks = c * T + tl.arange(0, T)
        tl.store(out_ptr + b * o_sb + toks[:, None] * o_sl + h * o_sh + pcols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(toks < L)[:, None])
        w = tl.exp(cs_end - cs) * cc
        vw = tl.trans((v * w[:, None]).to(DT))
        decay = tl.exp(cs_end)
        carry_lo = carry_lo * decay + tl.dot(vw, klo)
        carry_hi = carry_hi * decay + tl.dot(vw, khi)


def launches(b, l, h, g, n, p, r, device, dtype, seed=1):
    """The split forward run once on random inputs (bf16 activations when ``dtype`` is): its output and each
    launch's ``(grid, args, meta)`` by kernel name, for the walk to take the same arguments."""
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs
    x = random_inputs(b, l, h, g, n, p, r, device=device, seed=seed, dtype=torch.float32)
    x = {k: (t.to(dtype) if k in ACTIVATIONS else t) for k, t in x.items()}
    args = [x[k] if k != "angles" else x[k].expand(b, l, h, -1) for k in INPUT_NAMES]
    rec = {}
    real = scan._launch
    def spy(name, grid, *a, **meta):
        rec[name] = (grid, a, meta)
        return real(name, grid, *a, **meta)
    scan._launch = spy
    try:
        with torch.no_grad():
            out = scan.mimo_scan(*args)
    finally:
        scan._launch = real
    return out, rec


def main():
    mode = sys.argv[1]
    if mode == "interp":  # TRITON_INTERPRET=1, fp32
        b, l, h, g, n, p, r = 1, 37, 4, 2, 32, 32, 4
        out, rec = launches(b, l, h, g, n, p, r, "cpu", torch.float32)
        grid, a, meta = rec["fwd_chunk"]
        s_in = a[14]
        for ps in (1, 2):
            a = list(a)
            out2 = torch.empty_like(out)
            s2 = torch.empty_like(s_in)
            a[14], a[15] = s2, out2
            fwd_walk_kernel[(b * h, ps)](*a, **meta, STORE=True, PS=ps)
            print(f"PS={ps}: out max abs diff", (out - out2).abs().max().item(), "max", out.abs().max().item(),
                  "S_in max abs diff", (s_in - s2).abs().max().item(), "max", s_in.abs().max().item())
            print(f"PS={ps}: S_in equal", torch.equal(s_in, s2), "out equal", torch.equal(out, out2))
    elif mode == "time":  # on the GPU host: NAM56R's b2, bf16, CUDA events, medians of 10 after 2 warm-ups
        b, l, h, g, n, p, r = 2, 4096, 128, 8, 128, 64, 4
        out, rec = launches(b, l, h, g, n, p, r, "cuda", torch.bfloat16)
        (sg, sa, sm), (fg, fa, fm) = rec["state_walk"], rec["fwd_chunk"]
        s_in = fa[14]

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        from timing import median_ms  # bench/timing.py: the benches' CUDA-event median

        def timed(fn):
            return median_ms(fn, warmup=2, iters=10)

        base = timed(lambda: (scan._launch("state_walk", sg, *sa, **sm), scan._launch("fwd_chunk", fg, *fa, **fm)))
        print(f"| forward | ms | vs split | output, S_in bits |\n|---|---|---|---|\n| state_walk + fwd_chunk "
              f"({scan.CHOSEN.get('state_walk')}; {scan.CHOSEN.get('fwd_chunk')}) | {base:.3f} | 1.00x | |", flush=True)
        for ps, warps, maxnreg, store in [(1, 8, None, False), (1, 8, 128, False), (1, 4, None, False),
                                          (1, 8, None, True), (2, 4, None, False), (2, 8, None, False),
                                          (2, 4, None, True), (4, 4, None, False), (4, 8, None, False)]:
            a = list(fa)
            a[14], a[15] = torch.empty_like(s_in), torch.empty_like(out)
            extra = {"maxnreg": maxnreg} if maxnreg else {}
            run = lambda: fwd_walk_kernel[(b * h, ps)](*a, **fm, STORE=store, PS=ps, num_warps=warps, num_stages=1,
                                                       **extra)
            ms = timed(run)
            same = f"{torch.equal(a[15], out)}, {torch.equal(a[14], s_in) if store else '-'}"
            print(f"| fwd_walk PS {ps}, {warps} warps, maxnreg {maxnreg}, STORE {store} | {ms:.3f} | {base / ms:.2f}x "
                  f"| "
                  f"{same} (max diff {(a[15].float() - out.float()).abs().max().item():.2e}) |", flush=True)
    else:  # compile for sm_90
        from mimo_compile import compile_one, ptxas_info, record_launches  # gpu/mimo_compile.py

        # the scan's launches at b2, l=256, NAM56R's widths, bf16, recorded, not run (mimo_compile's recorder)
        rec = {name: (kernel, a, meta) for name, kernel, a, meta in record_launches()}
        _, a, meta = rec["fwd_chunk"]
        builds = [(1, 4, 1, None, 0), (1, 4, 1, None, 1), (1, 8, 1, None, 0), (1, 8, 1, None, 1),
                  (1, 8, 1, 128, 0), (1, 8, 2, None, 0), (1, 4, 1, 168, 0)]
        builds += [(ps, w, 1, m, 0) for ps in (2, 4) for w, m in ((4, None), (4, 168), (4, 128), (8, None), (8, 128))]
        for ps, warps, stages, maxnreg, store in builds:
            comp = compile_one(fwd_walk_kernel, a, {**meta, "STORE": bool(store), "PS": ps}, warps, stages, maxnreg)
            print(f"fwd_walk PS={ps} STORE={store} warps={warps} stages={stages} maxnreg={maxnreg}: shared "
                  f"{comp.metadata.shared} B, {ptxas_info(comp)}", flush=True)
        for name in ("state_walk", "fwd_chunk"):  # the shipped pair, each config of theirs
            kernel, a, meta = rec[name]
            for c in K.CONFIGS[name]:
                comp = compile_one(kernel, a, {**meta, **c.kwargs}, c.num_warps, c.num_stages, c.maxnreg)
                print(f"{name} {c}: shared {comp.metadata.shared} B, {ptxas_info(comp)}", flush=True)

if __name__ == "__main__":
    main()
