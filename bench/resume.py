"""What a local-engine resume costs before its first step, on the CPU, for a synthetic state: the integrity check
(the sha256 of every file against the manifest) and the DCP load, with the checkpoint written as one data file
and hashed and read on one thread (nam before 2026-11-28) against ``async_checkpoint.FILES`` files hashed and read
side by side (``checkpoint.hash_files``, ``SafeReader.read_data``).

    python bench/resume.py [--gb 2] [--threads 8] [--work DIR] [--json FILE]

The state: ``--gb`` GB of an fp32 model and its AdamW moments (1/3 each) in 64 tensors, a format-3 checkpoint of
it per layout under ``--work`` (the temp dir by default), read back right after it was written (the page cache
warm, as on a GPU host whose RAM holds the checkpoint; a cold disk adds its read time to both). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from nam_core.engine import async_checkpoint, checkpoint


def parts(gb: float):
    n = int(gb * 1e9 / 12 / 64)  # fp32 param + 2 fp32 moments = 12 bytes per element, in 64 tensors
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(64)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def write(root: Path, files: int, model, optimizer, scheduler) -> Path:
    async_checkpoint.FILES = files
    saver = async_checkpoint.AsyncSaver(pinned=False)
    checkpoint.start_save(root, 1, saver=saver, model=model, optimizer=optimizer, scheduler=scheduler,
                          extra={"record": {}}, keep=1)
    return checkpoint.finish_save(saver, root, model, optimizer)


def resume(folder: Path, threads: int, model, optimizer, scheduler) -> dict:
    checkpoint._DIGESTS.clear()  # a fresh process: nothing hashed yet
    checkpoint.HASH_THREADS = threads
    t0 = time.perf_counter()
    assert checkpoint.verify(folder) is not None
    t1 = time.perf_counter()
    checkpoint.load(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    t2 = time.perf_counter()
    return {"hash_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=checkpoint.HASH_THREADS)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nam-resume-", dir=args.work))
    model, optimizer, scheduler = parts(args.gb)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # the moments exist
    optimizer.zero_grad(set_to_none=True)
    rows = []
    try:
        for name, files, threads in (("before: 1 file, 1 thread", 1, 1),
                                     (f"after: {args.threads} files, {args.threads} threads", args.threads,
                                      args.threads)):
            folder = write(work / name.split(":")[0], files, model, optimizer, scheduler)
            size = sum(p.stat().st_size for p in (folder / "state").iterdir())
            fresh = parts(args.gb)
            rows.append({"layout": name, "gb": size / 1e9, **resume(folder, threads, *fresh)})
            for a, b in zip(fresh[0].parameters(), model.parameters()):
                assert torch.equal(a, b)
            del fresh
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} intra-op threads\n")
    print("| layout | checkpoint GB | sha256 check s | DCP load s | total s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['gb']:.2f} | {r['hash_s']:.2f} | {r['load_s']:.2f} | {r['total_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
