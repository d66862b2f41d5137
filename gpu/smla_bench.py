"""Issue 32 item 2 on the GPU host: sparse-mla's kernels before/after, tile variants, dense SDPA, one run.

1. sparse MLA at NAM56R's DSA shape (b=2, s=4096, 32 heads, dk 128, dv 64, top-k 256, bf16): forward and
   forward + backward ms of the kernels before this change (``gpu/smla_before/kernel_before.py``), of the new
   kernels under a few (block_n, value tile, warps) variants, and of dense SDPA; each variant's output and
   gradients against the default variant's (relative to max), the default's against the old kernels'.
2. index scores at NAM56R's indexer shape (b=2 = MBS 2, s=4096, 32 heads of 64): old fwd+bwd and per-kernel
   ms (dq, dk), the new backward kernels under a few tiles (per-kernel ms), each new tile's dq, dk, dw
   against the old kernels' (relative to max).
3. torch.profiler table of one fwd+bwd of each (default tiles).

    python gpu/smla_bench.py OUT_DIR

``SMLA_SMOKE=1 TRITON_INTERPRET=1``: the same code at s=64 on the CPU (interpreter), to check the script.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent / "smla_before"))
sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

import indexer_before  # noqa: E402
import kernel_before  # noqa: E402
from timing import median_ms  # noqa: E402

SMOKE = os.environ.get("SMLA_SMOKE") == "1"
DEV = "cpu" if SMOKE else "cuda"
if SMOKE:
    def median_ms(fn, *, warmup, iters):  # noqa: F811
        t = time.time()
        fn()
        return (time.time() - t) * 1e3
    torch.cuda.get_device_name = lambda: "cpu (smoke)"
    torch.cuda.synchronize = lambda: None
    torch.cuda.empty_cache = lambda: None

from nam_plugin_sparse_mla import indexer, kernel  # noqa: E402
from nam_plugin_sparse_mla.attention import dense_attention  # noqa: E402
from nam_plugin_sparse_mla.selftest import random_inputs  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-out")
OUT.mkdir(parents=True, exist_ok=True)
RESULTS: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
T0 = time.time()


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def save():
    (OUT / "smla_bench.json").write_text(json.dumps(RESULTS, indent=2) + "\n")


# --- 1. sparse MLA --------------------------------------------------------------------------------------
B, S, H, DK, DV, TOPK = 2, 64 if SMOKE else 4096, 32, 128, 64, 16 if SMOKE else 256
SCALE = DK**-0.5
q, kv, idx = random_inputs(B, S, H, DK, TOPK, dtype=torch.bfloat16, device=DEV, seed=0)
q.requires_grad_(), kv.requires_grad_()
do = torch.randn(B, S, H, DV, device=DEV, dtype=torch.bfloat16)


def attn_timing(fn):
    def fwd():
        with torch.no_grad():
            fn()

    def step():
        q.grad = kv.grad = None
        fn().backward(do)

    step()
    out = fn().detach()
    q.grad = kv.grad = None
    fn().backward(do)
    grads = (out, q.grad.clone(), kv.grad.clone())
    f = median_ms(fwd, warmup=2, iters=10)
    fb = median_ms(step, warmup=2, iters=10)
    return {"fwd_ms": f, "fwd_bwd_ms": fb, "bwd_ms": fb - f}, grads


sparse = {}
dense_row, _ = attn_timing(lambda: dense_attention(q, kv, scale=SCALE, d_v=DV))
sparse["sdpa dense"] = dense_row
old_row, old_out = attn_timing(lambda: kernel_before.sparse_mla(q, kv, idx, scale=SCALE, d_v=DV)[0])
sparse["before"] = old_row
FWD = [  # (block_n, warps, stages, value from key); the first is kernel.TILES' default
    (128, 4, 3, True), (128, 4, 2, True), (256, 4, 2, True), (128, 4, 3, False), (64, 4, 3, False),
    (128, 4, 4, True)]
BWD = [  # (block_n, warps, stages, value from key, keys as rows)
    (64, 4, 3, True, False), (64, 4, 3, True, True), (32, 4, 3, True, True), (64, 8, 3, True, True),
    (128, 8, 2, True, True), (64, 4, 2, True, False), (32, 4, 2, True, False), (64, 4, 2, True, True)]
DEFAULT = {kind: dict(kernel.TILES[kind]) for kind in ("fwd", "bwd")}


def set_tile(kind, tile):
    bn, warps, stages, vfk, *rows = tile
    kernel.TILES[kind].update(block_n=bn, num_warps=warps, num_stages=stages, value_from_key=vfk)
    if rows:
        kernel.TILES[kind].update(keys_as_rows=rows[0])


def new_sparse():
    return kernel.sparse_mla(q, kv, idx, scale=SCALE, d_v=DV)[0]


default_row, default_out = attn_timing(new_sparse)
default_row["vs_before"] = dict(zip(("out", "dq", "dkv"), (rel(a, b) for a, b in zip(default_out, old_out))))
sparse["after (default tiles)"] = default_row
save()
best = {"fwd": (default_row["fwd_ms"], FWD[0]), "bwd": (default_row["bwd_ms"], BWD[0])}
for kind, tiles in (("fwd", FWD[1:2 if SMOKE else None]), ("bwd", BWD[1:2 if SMOKE else None])):
    for tile in tiles:
        name = f"{kind} {tile}"
        if time.time() - T0 > 36:
            sparse[name] = {"skipped": "time"}
            continue
        set_tile(kind, tile)
        try:
            row, outs = attn_timing(new_sparse)
        except Exception as e:  # a variant that does not compile (shared memory, registers) is recorded, not fatal
            sparse[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        finally:
            kernel.TILES[kind].update(DEFAULT[kind])
        row["vs_default"] = dict(zip(("out", "dq", "dkv"), (rel(a, b) for a, b in zip(outs, default_out))))
        sparse[name] = row
        if row[f"{kind}_ms"] < best[kind][0]:
            best[kind] = (row[f"{kind}_ms"], tile)
        save()
set_tile("fwd", best["fwd"][1])
set_tile("bwd", best["bwd"][1])
row, outs = attn_timing(new_sparse)
row["tiles"] = {"fwd": best["fwd"][1], "bwd": best["bwd"][1]}
row["vs_before"] = dict(zip(("out", "dq", "dkv"), (rel(a, b) for a, b in zip(outs, old_out))))
sparse["after (best tiles)"] = row
kernel.TILES["fwd"].update(DEFAULT["fwd"])
kernel.TILES["bwd"].update(DEFAULT["bwd"])


@triton.jit
def _scatter_probe(KV, IDX, DKV, s, topk, DK: tl.constexpr, BN: tl.constexpr, GATHER: tl.constexpr):
    """The backward's memory traffic alone: per token, its slots' key rows gathered (GATHER) and / or an fp32
    [BN, DK] tile atomically added at them; no dots. A floor for the backward, and what the atomics cost."""
    row = tl.program_id(0).to(tl.int64)
    b = row // s
    t = row % s
    offs_dk = tl.arange(0, DK)
    acc = tl.zeros([BN, DK], tl.float32)
    for start in range(0, topk, BN):
        offs_n = start + tl.arange(0, BN)
        idx = tl.load(IDX + row * topk + offs_n, mask=offs_n < topk, other=-1)
        live = (idx >= 0) & (idx <= t)
        rows = b * s + tl.where(live, idx, 0).to(tl.int64)
        if GATHER:
            acc += tl.load(KV + rows[:, None] * DK + offs_dk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        else:
            acc += 1.0
        tl.atomic_add(DKV + rows[:, None] * DK + offs_dk[None, :], acc, mask=live[:, None], sem="relaxed")


if not SMOKE and time.time() - T0 < 40:
    dkv32 = torch.zeros(B * S, DK, device=DEV)
    for gather in (False, True):
        def probe(gather=gather):
            _scatter_probe[(B * S,)](kv, idx, dkv32, S, TOPK, DK=DK, BN=64, GATHER=gather, num_warps=4)
        probe()
        sparse[f"probe: {'gather + ' if gather else ''}atomic scatter only"] = {
            "bwd_ms": median_ms(probe, warmup=2, iters=10)}

for row in sparse.values():
    if "fwd_bwd_ms" in row:
        row["time_vs_sdpa"] = row["fwd_bwd_ms"] / dense_row["fwd_bwd_ms"]
RESULTS["sparse_mla"] = {"shape": dict(b=B, s=S, h=H, dk=DK, dv=DV, topk=TOPK), "rows": sparse}
save()
print(f"sparse MLA b={B} s={S} h={H} dk={DK} dv={DV} top-k {TOPK} bf16, {RESULTS['gpu']}")
for name, row in sparse.items():
    print(f"  {name:<16} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
del q, kv, idx, do
torch.cuda.empty_cache()

# --- 2. index scores --------------------------------------------------------------------------------
IB, IH, ID = 2, 32, 64
g = torch.Generator(device="cpu").manual_seed(0)
iq = torch.randn(IB, S, IH, ID, generator=g).to(DEV, torch.bfloat16)
ik = torch.randn(IB, S, ID, generator=g).to(DEV, torch.bfloat16)
iw = (torch.randn(IB, S, IH, generator=g) * (IH * ID) ** -0.5).to(DEV)
grad = torch.randn(IB, S, S, device=DEV)
index = {}


def old_bwd():
    dq, dw = torch.empty_like(iq), torch.empty_like(iw)
    part = torch.empty(8, IB, S, ID, device=DEV)
    bm, bn, warps = indexer_before.SCORE_TILES["dq"]
    indexer_before._scores_bwd_dq[(IH, triton.cdiv(S, bm), IB)](iq, ik, iw, grad, dq, dw, S, IH, D=ID, BM=bm, BN=bn,
                                                                PREC="tf32x3", num_warps=warps)
    return dq, dw, part


def old_dk(part):
    bm, bn, warps = indexer_before.SCORE_TILES["dk"]
    indexer_before._scores_bwd_dk[(triton.cdiv(S, bn), 8, IB)](iq, ik, iw, grad, part, S, IH, 4, D=ID, BM=bm, BN=bn,
                                                               PREC="tf32x3", num_warps=warps)
    return part


dq0, dw0, part0 = old_bwd()
old_dk(part0)
ref = (dq0, part0.sum(0), dw0)
index["before"] = {"dq_ms": median_ms(old_bwd, warmup=2, iters=10),
                   "dk_ms": median_ms(lambda: old_dk(part0), warmup=2, iters=10)}
q2, k2, w2 = (t.clone().requires_grad_() for t in (iq, ik, iw))


def fwd_bwd(fn):
    def step():
        q2.grad = k2.grad = w2.grad = None
        fn(q2, k2, w2).backward(grad)
    return median_ms(step, warmup=2, iters=10)


index["before"]["fwd_bwd_ms"] = fwd_bwd(indexer_before.index_scores)
index["after"] = {"fwd_bwd_ms": fwd_bwd(indexer.index_scores)}


def new_dq(tile):
    bt, hg, bn, warps, stages = indexer.bwd_tile(tile, IH)
    dq, dw = torch.empty_like(iq), torch.empty_like(iw)
    indexer._scores_bwd_dq[(triton.cdiv(S, bt), triton.cdiv(IH, hg), IB)](
        iq, ik, iw, grad, dq, dw, S, IH, D=ID, BT=bt, HG=hg, BN=bn, SPLIT=True, PREC="tf32x3", num_warps=warps,
        num_stages=stages)
    return dq, dw


def new_dk(tile):
    bt, hg, bn, warps, stages = indexer.bwd_tile(tile[:5], IH)
    groups = triton.cdiv(IH, hg)
    part = torch.empty(groups, IB, S, ID, device=DEV)
    indexer._scores_bwd_dk[(triton.cdiv(S, bn), groups, IB)](
        iq, ik, iw, grad, part, S, IH, D=ID, BT=bt, HG=hg, BN=bn, SPLIT=True, PREC="tf32x3", KEYS_AS_ROWS=tile[5],
        num_warps=warps, num_stages=stages)
    return part


DQ_TILES = [indexer.BWD_TILES["dq"], (64, 32, 32, 4, 3), (128, 32, 32, 4, 2), (128, 32, 16, 4, 3),
            (256, 32, 32, 8, 3), (128, 32, 64, 4, 3)]
DK_TILES = [indexer.BWD_TILES["dk"] + (indexer.DK_KEYS_AS_ROWS,), (128, 8, 128, 8, 2, True), (128, 8, 64, 8, 3, True),
            (64, 8, 64, 4, 3, True), (128, 8, 64, 4, 3, True), (128, 16, 128, 8, 2, True), (64, 8, 128, 4, 2, True)]
ORDER = [(kind, tile) for pair in zip(DQ_TILES, DK_TILES) for kind, tile in zip(("dq", "dk"), pair)]
ORDER += [("dk", tile) for tile in DK_TILES[len(DQ_TILES):]]
best_index = {}
for kind, tile in ORDER:  # dq and dk alternate, each default first, so a time cut leaves both measured
    launch = new_dq if kind == "dq" else new_dk
    if time.time() - T0 > 62:
        index[f"{kind} {tile}"] = {"skipped": "time"}
        continue
    try:
        out = launch(tile)
        torch.cuda.synchronize()
        ms = median_ms(lambda: launch(tile), warmup=2, iters=10)
    except Exception as e:
        index[f"{kind} {tile}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        continue
    if kind == "dq":
        err = {"dq": rel(out[0], ref[0]), "dw": rel(out[1], ref[2])}
    else:
        err = {"dk": rel(out.sum(0), ref[1])}
    index[f"{kind} {tile}"] = {"ms": ms, "vs_before": err}
    if ms < best_index.get(kind, (float("inf"),))[0]:
        best_index[kind] = (ms, tile)
    save()
if {"dq", "dk"} <= set(best_index):
    dk_tile = best_index["dk"][1]
    indexer.DK_KEYS_AS_ROWS, saved_rows = dk_tile[5], indexer.DK_KEYS_AS_ROWS
    tiles = {**indexer.SCORE_TILES, "dq": best_index["dq"][1], "dk": dk_tile[:5]}
    best_fn = lambda q, k, w: indexer.IndexScoresFunction.apply(q, k, w, tiles)  # noqa: E731
    index["after (best tiles)"] = {"fwd_bwd_ms": fwd_bwd(best_fn),
                                   "dq_ms": best_index["dq"][0], "dk_ms": best_index["dk"][0],
                                   "tiles": {"dq": best_index["dq"][1], "dk": dk_tile}}
    indexer.DK_KEYS_AS_ROWS = saved_rows
RESULTS["index_scores"] = {"shape": dict(b=IB, s=S, heads=IH, d=ID), "rows": index}
save()
print(f"index scores b={IB} s={S} {IH} heads of {ID}")
for name, row in index.items():
    print(f"  {name:<28} {row}")

# --- 3. profile ---------------------------------------------------------------------------------------
if time.time() - T0 < 68:
    from torch.profiler import ProfilerActivity, profile

    q, kv, idx = random_inputs(B, S, H, DK, TOPK, dtype=torch.bfloat16, device=DEV, seed=0)
    q.requires_grad_(), kv.requires_grad_()
    do = torch.randn(B, S, H, DV, device=DEV, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU if SMOKE else ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            kernel.sparse_mla(q, kv, idx, scale=SCALE, d_v=DV)[0].backward(do)
            q2.grad = k2.grad = w2.grad = None
            indexer.index_scores(q2, k2, w2).backward(grad)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total" if SMOKE else "cuda_time_total", row_limit=15)
    (OUT / "smla_profile.txt").write_text(table + "\n")
    print(table)


def compiled(fn) -> list:
    """Registers, spills, shared memory, warps and stages of every compiled variant of a Triton kernel."""
    try:
        rows = []
        for entry in fn.device_caches.values():
            for key, k in entry[0].items():
                rows.append({"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared,
                             "warps": k.metadata.num_warps, "stages": k.metadata.num_stages,
                             "key": str(key)[-160:]})
        return rows
    except Exception as e:  # the cache layout differs between Triton releases: record, do not fail
        return [{"error": f"{type(e).__name__}: {e}"}]


RESULTS["compiled"] = {name: compiled(fn) for name, fn in (
    ("sparse fwd", kernel._sparse_mla_fwd), ("sparse bwd", kernel._sparse_mla_bwd),
    ("before sparse fwd", kernel_before._sparse_mla_fwd), ("before sparse bwd", kernel_before._sparse_mla_bwd),
    ("index dq", indexer._scores_bwd_dq), ("index dk", indexer._scores_bwd_dk),
    ("before index dq", indexer_before._scores_bwd_dq), ("before index dk", indexer_before._scores_bwd_dk))}
save()
for name, rows in RESULTS["compiled"].items():
    print(name, [{k: v for k, v in r.items() if k != "key"} for r in rows])
print(f"total {time.time() - T0:.0f} s")
