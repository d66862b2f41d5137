"""What a checkpoint costs a run of full NAM56R on one GPU: the training stall per save, the save's background
write, and the time from a ``--resume auto`` start to its first step. Local engine: the async DCP checkpoints
(nam_core/engine/async_checkpoint.py) and the synchronous torch.save ones (``train.async_checkpoints=false``).
Megatron engine (``--engine megatron``, async only): Megatron's ``dist_checkpointing`` with its async save
(nam_core/engine/megatron/checkpoint.py).

    python bench/checkpoint.py [--steps 4] [--every 2] [--mbs 2] [--numerics bf16] [--work DIR] [--host-buffers register|alloc] --json bench/results/checkpoint_h200.json
    python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments --set te.fp8=off \
        --set train.recompute=mamba [--steps 4 --every 4 --mbs 2] --json bench/results/checkpoint_megatron_h200.json

The async saver builds its host buffers on a background thread from the first step on; a save that comes before
the build ends waits for it (in its stall). The bench prints the build's line: its time, the first save's wait,
and the steps that ran during the build (what the build cost them). To see a first save that finds them ready,
save after more steps than the build takes (~25 s of steps for 27 GB: ``--steps 36 --every 36`` at 0.93 s
steps). ``--host-buffers`` picks how they are page-locked (async_checkpoint.HOST_BUFFERS), to compare.

Per mode: ``nam train --recipe nam56r --max-steps STEPS --set train.checkpoint_every=EVERY`` (its run.log notes
each save: the stall the training thread paid, the background write), then ``nam train --resume auto
--max-steps STEPS+1`` on the same folder, timed from its launch to its first metrics record (the step after the
checkpoint), with the load time it notes (and, megatron engine, the load's peak GPU memory). Prints one table;
the run folders are removed unless ``--keep``.
Disk: a full NAM56R checkpoint at ``--numerics bf16`` (the default here) is 27 GB and one is kept
(``train.keep_checkpoints=1``), so a save in progress needs two of them, ~55 GB, under ``--work``; at the
recipe's fp32-master numerics one is 4.73e9 x (2 + 4 + 8) bytes = 66 GB, more than the 64 GiB disk of our GPU
host, so the host measures bf16 (the numerics of the ~90 s stall the synchronous writer was measured at). The
megatron engine refuses bf16 numerics; its smallest checkpoint is ``bf16-moments`` (fp32 masters, bf16 moments,
which it runs through Transformer Engine's FusedAdam: ``--plugins te``): 4.73e9 x (2 + 4 + 4) bytes = 47 GB, one
save only (a second would need two on the disk).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAVED = re.compile(r"checkpoint (?:\S*/)?(step-\d+): training paused ([\d.]+) s(?:.*?written in ([\d.]+) s)?")
WAITED = re.compile(r"checkpoint (?:\S*/)?(step-\d+): training waited ([\d.]+) s for the previous")
RESUMED = re.compile(r"resumed from .* at step (\d+) \(loaded in ([\d.]+) s(?:, peak GPU memory ([\d.]+) GiB)?"
                     r"(?:; ([^)]*) s)?\)")
"""The resume's note; the megatron engine adds the load's peak GPU memory (torch.cuda.max_memory_allocated) and
its parts' seconds (``check 1.2, targets 0.4, read ...``)."""


BUFFERS = re.compile(r"its host buffers \(([\d.]+) GB, (\w+)\) took ([\d.]+) s to build on a background thread; "
                     r"the save waited ([\d.]+) s")
BUILDING = "checkpoint host buffers: building"
WAY = ("import runpy, sys; import nam_core.engine.async_checkpoint as a; a.HOST_BUFFERS = sys.argv.pop(1); "
       "sys.argv[0] = 'nam'; runpy.run_module('nam_cli', run_name='__main__', alter_sys=True)")
"""``nam`` with async_checkpoint.HOST_BUFFERS set first (``--host-buffers``): a bench's choice, not a setting."""


def _nam(*args: str, host_buffers: str | None = None) -> list[str]:
    if host_buffers:
        return [sys.executable, "-c", WAY, host_buffers, *args]
    return [sys.executable, "-m", "nam_cli", *args]


def _train(run_dir: Path, args, steps: int, mode: str, *extra: str) -> subprocess.Popen:
    sets = [f"train.checkpoint_every={args.every}", f"train.micro_batch_size={args.mbs}",
            f"train.async_checkpoints={'true' if mode == 'async' else 'false'}", "train.keep_checkpoints=1",
            f"train.optimizer_numerics={args.numerics}", *args.set]
    engine = ["--engine", "megatron", "--nproc", "1"] if args.engine == "megatron" else []
    plugins = ["--plugins", args.plugins] if args.plugins else []
    return subprocess.Popen(_nam("train", "--recipe", "nam56r", *engine, *plugins, "--max-steps", str(steps),
                                 "--run-dir", str(run_dir), "-q", *(a for s in sets for a in ("--set", s)), *extra,
                                 host_buffers=args.host_buffers))


def _first_record_after(run_dir: Path, step: int, proc: subprocess.Popen) -> tuple[float | None, dict | None]:
    """Seconds until metrics.jsonl holds the record of step ``step + 1`` (polled every 0.2 s), and the record."""
    start = time.perf_counter()
    path = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("step") == step + 1:
                    return time.perf_counter() - start, record
        time.sleep(0.2)
    return None, None


def measure(mode: str, args, work: Path) -> dict:
    run_dir = work / mode
    proc = _train(run_dir, args, args.steps, mode)
    if proc.wait():
        raise SystemExit(f"error: nam train ({mode}) exited with {proc.returncode}; its log: {run_dir / 'run.log'}")
    log = (run_dir / "run.log").read_text()
    waited = {name: float(w) for name, w in WAITED.findall(log)}  # a save that waited for the one before it
    saves = [{"checkpoint": m[0], "stall_s": float(m[1]) + waited.get(m[0], 0.0), "copy_s": float(m[1]),
              "waited_s": waited.get(m[0], 0.0), "write_s": float(m[2]) if m[2] else None}
             for m in SAVED.findall(log)]
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["step_time_s"] for r in records[1:]]
    built = BUFFERS.findall(log)
    buffers = {"gb": float(built[0][0]), "how": built[0][1], "build_s": float(built[0][2]),
               "waited_s": float(built[0][3])} if built else None
    if buffers:  # the steps that ran while the buffers were being built (after the first): what the build cost them
        by_step = [r["step_time_s"] for r in records[1:]]
        during, left = [], buffers["build_s"]
        for t in by_step:
            if left <= 0:
                break
            during.append(t)
            left -= t
        buffers["steps_during_build_s"] = during
    to_first = record = failed = None
    if not args.no_resume:
        quiet = ("--set", "train.checkpoint_every=0") if args.no_save_after_resume else ()
        resume = _train(run_dir, args, args.steps + 1, mode, "--resume", "auto", *quiet)
        to_first, record = _first_record_after(run_dir, args.steps, resume)
        failed = (f"the resume exited with {resume.returncode}; its log: {run_dir / 'run.log'} (kept)"
                  if resume.wait() else None)  # the saves' row is still printed; main exits 1
    loaded = RESUMED.findall((run_dir / "run.log").read_text())
    phases = dict((k, float(v)) for k, v in (part.split() for part in loaded[-1][3].split(", "))) \
        if loaded and loaded[-1][3] else None
    summary = run_dir / "summary.json"  # the resume's, when it finished
    startup = json.loads(summary.read_text()).get("startup_s") if not args.no_resume and summary.is_file() else None
    if not args.keep and not failed:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"mode": mode, "resume_failed": failed, "saves": saves, "host_buffers": buffers,
            "median_step_s": sorted(step_s)[len(step_s) // 2] if step_s else None,
            "resume_to_first_step_s": to_first, "resume_first_step_s": record and record["step_time_s"],
            "resume_load_s": float(loaded[-1][1]) if loaded else None,
            "resume_load_peak_gib": float(loaded[-1][2]) if loaded and loaded[-1][2] else None,
            "resume_load_phases_s": phases, "resume_startup_s": startup}


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["local", "megatron"], default="local")
    ap.add_argument("--plugins", default="", help="nam train --plugins (e.g. te, which megatron's bf16-moments needs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more nam train --set")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["async", "sync"])
    ap.add_argument("--numerics", default="bf16", help="train.optimizer_numerics (see the disk note above)")
    ap.add_argument("--work", type=Path, default=None, help="where the run folders go (default: the temp dir)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-resume", action="store_true", help="measure the saves only (the resume's columns: -)")
    ap.add_argument("--no-save-after-resume", action="store_true",
                    help="the resume runs with train.checkpoint_every=0: no save of its own (a host whose disk "
                         "holds one checkpoint, not two)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--host-buffers", choices=["register", "alloc"], default=None,
                    help="how the async saver page-locks its host buffers (async_checkpoint.HOST_BUFFERS; "
                         "default: nam's)")
    args = ap.parse_args()
    if args.engine == "megatron" and (args.modes != ["async"] or args.host_buffers):
        ap.error("--engine megatron measures its async save only (--modes async) and takes no --host-buffers: "
                 "Megatron copies the shards into torch's page-locked host allocator")
    work = Path(tempfile.mkdtemp(prefix="nam-checkpoint-", dir=args.work))
    rows = [measure(mode, args, work) for mode in args.modes]
    print(f"\n{args.engine} engine, MBS {args.mbs}, {args.numerics}, a save every {args.every} of {args.steps} steps")
    print("\n| checkpoints | stall per save s | background write s | median step s | resume to first step s "
          "| of which load s | load's peak GPU memory GiB | first step after resume s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        stalls = ", ".join(f"{s['stall_s']:.1f}" for s in r["saves"])
        writes = ", ".join(f"{s['write_s']:.1f}" for s in r["saves"] if s["write_s"] is not None) or "-"
        print(f"| {r['mode']} | {stalls} | {writes} | {_f(r['median_step_s'], 2)} | {_f(r['resume_to_first_step_s'])} "
              f"| {_f(r['resume_load_s'])} | {_f(r['resume_load_peak_gib'])} | {_f(r['resume_first_step_s'])} |")
    for r in rows:
        if b := r["host_buffers"]:
            during = ", ".join(f"{t:.2f}" for t in b["steps_during_build_s"]) or "-"
            print(f"\n{r['mode']}: host buffers {b['gb']:.1f} GB ({b['how']}) built in {b['build_s']:.1f} s on a "
                  f"background thread; the first save waited {b['waited_s']:.1f} s for them; the steps during the "
                  f"build took {during} s (median step {_f(r['median_step_s'], 2)} s)")
        if p := r["resume_load_phases_s"]:
            print(f"{r['mode']}: the resume's load, by part (s): " + ", ".join(f"{k} {v:.1f}" for k, v in p.items()))
        if st := r["resume_startup_s"]:
            print(f"{r['mode']}: the resume's launch to first step, by part (s): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in st.items()))
    if args.json:
        args.json.write_text(json.dumps({"meta": {"date": datetime.date.today().isoformat(), "steps": args.steps,
                                                  "every": args.every, "mbs": args.mbs, "engine": args.engine,
                                                  "plugins": args.plugins, "sets": args.set,
                                                  "numerics": args.numerics,
                                                  "host_buffers": args.host_buffers}, "rows": rows}, indent=2))
        print(f"\nwrote {args.json}")
    failed = [f"error: {r['mode']}: {r['resume_failed']}" for r in rows if r["resume_failed"]]
    if failed:
        print("\n" + "\n".join(failed))
        return 1
    shutil.rmtree(work, ignore_errors=True) if not args.keep else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
