"""The memory plan against every measured peak: ``nam56r.memory``'s estimate of the allocator's peak for each run
in bench/results/ that recorded one (``torch.cuda.max_memory_allocated``, H200), its error, and whether the plan
says it fits. CPU only: the plan counts parameters on the meta device and reads nam56r/activations.json.

    python bench/memory_plan.py --json bench/results/plan_vs_measured.json
"""

import argparse
import datetime
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.10
"""Issue 30: the estimate within 10% of a measured peak."""


@dataclass(frozen=True)
class Peak:
    """One measured run: where its peak is (``file`` and the row whose fields match ``match``; ``path``: a key
    path into the file instead of a row), and the run it was (engine, numerics, recompute, layout, MBS)."""

    file: str
    match: dict
    engine: str
    numerics: str
    recompute: tuple[str, ...] = ()
    world: int = 1
    ep: int = 1
    mbs: int | None = None
    path: tuple[str, ...] = ()
    note: str = ""
    grad_bytes: int = 4
    """The megatron engine's gradient buffers, bytes per parameter (``train.grad_reduce_in_fp32``)."""
    ran: bool = field(default=True)


OLD_LOCAL = "local engine before train.optimizer_numerics: bf16 parameters and bf16 moments (= bf16)"
PEAKS = (
    Peak("megatron_throughput_x4.json", {"engine": "local", "mbs": 1}, "local", "bf16", note=OLD_LOCAL),
    Peak("megatron_throughput_h200_1gpu.json", {"engine": "local", "mbs": 2}, "local", "bf16", note=OLD_LOCAL),
    Peak("megatron_throughput_h200_local_mbs4.json", {"engine": "local", "mbs": 4}, "local", "bf16", note=OLD_LOCAL),
    Peak("numerics_local_mbs4_h200.json", {"numerics": "bf16"}, "local", "bf16"),
    Peak("numerics_local_mbs4_h200.json", {"numerics": "stochastic-rounding"}, "local", "stochastic-rounding"),
    Peak("numerics_recompute_local_mbs4_h200.json", {"recompute": "mamba"}, "local", "fp32-master", ("mamba",)),
    Peak("megatron_throughput_h200_local_mbs4_fp32_master_mamba_scan.json", {"recompute": "mamba-scan"}, "local",
         "fp32-master", ("mamba-scan",)),
    Peak("megatron_throughput_x4.json", {"engine": "megatron", "gpus": 1}, "megatron", "fp32-master"),
    Peak("megatron_throughput_h200_1gpu.json", {"engine": "megatron"}, "megatron", "fp32-master"),
    Peak("megatron_throughput_x4.json", {"engine": "megatron", "gpus": 2}, "megatron", "fp32-master", world=2, ep=2),
    Peak("megatron_throughput_x4_mbs.json", {"gpus": 2, "mbs": 2}, "megatron", "fp32-master", world=2, ep=2),
    Peak("megatron_throughput_x4.json", {"engine": "megatron", "gpus": 4}, "megatron", "fp32-master", world=4, ep=4),
    Peak("megatron_throughput_x4_mbs.json", {"gpus": 4, "mbs": 2}, "megatron", "fp32-master", world=4, ep=4),
    Peak("megatron_throughput_x4_mbs.json", {"gpus": 4, "mbs": 3}, "megatron", "fp32-master", world=4, ep=4),
    Peak("memory_ep8_mbs8_one_gpu.json", {}, "megatron", "fp32-master", ("mamba", "moe"), world=8, ep=8, mbs=8,
         path=("measured", "peak_gib"),
         note="one GPU at one EP 8 rank's shapes (bench/megatron.py memory: nam's blocks, the engine's static layout)"),
    Peak("megatron_mbs4_te_fused_mamba_h200.json", {"mbs": 4}, "megatron", "fp32-master, fused", ("mamba",),
         note="TE bf16 linears, train.fused_master_weights (fp32 masters as bf16 weights + remainders)"),
    Peak("megatron_mbs4_te_bf16grads_mamba_h200.json", {"mbs": 4}, "megatron", "fp32-master", ("mamba",),
         grad_bytes=2, note="TE bf16 linears, train.grad_reduce_in_fp32=false"),
    Peak("local_mbs4_fp32_master_mamba_scan_h200_2026-11-28.json", {"mbs": 4}, "local", "fp32-master",
         ("mamba-scan",)),
)
"""Every run in bench/results with a recorded peak of full NAM56R at sequence 4096 (one H200 each)."""


def measured(peak: Peak) -> tuple[float | None, int, dict]:
    """(peak GiB or None, MBS, the file's meta) of ``peak``."""
    if not peak.file:
        return None, peak.mbs, {}
    data = json.loads((RESULTS / peak.file).read_text())
    if peak.path:
        value = data
        for key in peak.path:
            value = value[key]
        return value, peak.mbs, data.get("meta", {})
    rows = [r for r in data["rows"] if all(r.get(k) == v for k, v in peak.match.items())]
    if len(rows) != 1:
        raise ValueError(f"{peak.file}: {len(rows)} rows match {peak.match}, expected 1")
    return rows[0]["peak_gib"], rows[0]["mbs"], data.get("meta", {})


def planned(peak: Peak, mbs: int, cfg, split) -> dict:
    """The plan's estimate for ``peak``'s run at ``mbs``: the allocator's peak and whether it fits an H200."""
    from nam56r import memory

    dense, routed = split
    if peak.engine == "local":
        plan = memory.local_plan(dense + routed, 2, numerics=peak.numerics, mbs=mbs, cfg=cfg, kinds=peak.recompute)
        return {"plan_gib": plan["total_gib"], "static_gib": plan["total_gib"] - plan["other_gib"],
                "fits": plan["total_gib"] + memory.OUTSIDE_ALLOCATOR_GIB <= memory.H200_GIB, "peak_at": plan["peak_at"]}
    plan, _ = memory.megatron_estimate(cfg, world=peak.world, ep=peak.ep, mbs=mbs, kinds=peak.recompute,
                                       numerics=peak.numerics, split=split, grad_bytes=peak.grad_bytes)
    return {"plan_gib": plan.total_gib, "static_gib": plan.static_gib, "fits": plan.fits(), "peak_at": None}


def table() -> list[dict]:
    from nam56r.memory import parameter_split
    from nam56r.recipes import get_recipe

    cfg = get_recipe("nam56r").model
    split = parameter_split(cfg)
    rows = []
    for peak in PEAKS:
        got, mbs, meta = measured(peak)
        plan = planned(peak, mbs, cfg, split)
        error = (plan["plan_gib"] - got) / got if got is not None else None
        rows.append({"source": peak.file or None, "date": meta.get("date"), "gpu": meta.get("gpu"),
                     "engine": peak.engine, "world": peak.world, "ep": peak.ep, "mbs": mbs,
                     "numerics": peak.numerics, "recompute": list(peak.recompute), "measured_gib": got, **plan,
                     "error": error, "within_target": None if error is None else abs(error) <= TARGET,
                     "note": peak.note})
    return rows


def markdown(rows: list[dict]) -> list[str]:
    out = ["| engine | GPUs, EP | MBS | numerics | recompute | measured peak GiB | plan GiB | plan vs measured "
           "| plan: fits 139.8 GiB | source |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        got = "ran, not recorded" if r["measured_gib"] is None else f"{r['measured_gib']:.2f}"
        err = "" if r["error"] is None else f"{r['error']:+.1%}"
        out.append(f"| {r['engine']} | {r['world']}, {r['ep']} | {r['mbs']} | {r['numerics']} "
                   f"| {','.join(r['recompute']) or 'none'} | {got} | {r['plan_gib']:.2f} | {err} "
                   f"| {'yes' if r['fits'] else 'no'} | {r['source'] or r['note']} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from nam56r.memory import load_constants

    rows = table()
    constants = load_constants().meta
    print(f"plan (nam56r/memory.py; activation constants: {constants['gpu']}, {constants['date']}) against every "
          f"measured peak of full NAM56R in bench/results (H200); target |error| <= {TARGET:.0%}\n")
    print("\n".join(markdown(rows)))
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    print(f"\n{len(errors)} peaks: largest |error| {max(errors):.1%}, "
          f"{sum(e <= TARGET for e in errors)} within {TARGET:.0%}")
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "target": TARGET,
                "activation_constants": {k: constants[k] for k in ("date", "gpu", "command")},
                "command": "python bench/memory_plan.py " + " ".join(sys.argv[1:])}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
