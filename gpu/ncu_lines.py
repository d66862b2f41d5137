"""Nsight Compute's warp-stall samples by source line, from the SASS page and a disassembly with line info.

    on the GPU host:  ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv
    here:             python gpu/mimo_compile.py KERNEL --warps W --stages S --dump DIR   (the launch's config)
                      python gpu/ncu_lines.py SASS.csv[.gz] DIR/KERNEL....sass [--source kernels.py] [--section N]
                          [--top 40] [--json OUT]

ncu's CUDA-source page came out without counters for Triton's kernels (r37), but its SASS page has them per
instruction. A kernel compiled offline by the same Triton and ptxas for the same config is the same SASS; this
checks that (every opcode in order) and then sums each instruction's samples and stall reasons onto the source
line nvdisasm gives it. The line is the innermost one: an instruction of a helper (``_load_rows``) counts on the
helper's line, whichever call it came from.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import re
import sys

import ncu_stalls  # gpu/, beside this script: the opcode of a SASS line, as the stall summary groups them


def read_sass_csv(path: str, section: int = 0) -> tuple[list[str], list[list[str]]]:
    """Kernel launch ``section`` (0: the first) of ncu's SASS page: (header, rows)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        launches = ncu_stalls.sections(f.read())
    if section >= len(launches):
        raise SystemExit(f"error: {path} holds {len(launches)} kernel launches; there is no section {section}")
    header, *rows = list(csv.reader(launches[section][1]))
    return header, rows


def read_disassembly(path: str) -> list[tuple[str, int, str]]:
    """(file, line, instruction) for every instruction of ``nvdisasm -g`` output, in address order."""
    out, where = [], ("?", 0)
    for text in open(path):
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', text)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$", text)
        if m:
            out.append((where[0], where[1], m.group(2)))
    return out


def opcode(instruction: str) -> str:
    """``ncu_stalls.opcode``, a dual-issue brace of nvdisasm's output passed over."""
    return ncu_stalls.opcode(instruction.replace("{", " "))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sass_csv")
    ap.add_argument("disassembly")
    ap.add_argument("--source", default=None, help="the kernel source the disassembly was compiled from, to show")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--section", type=int, default=0, help="which kernel launch of the page (0: the first)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    header, rows = read_sass_csv(a.sass_csv, a.section)
    dis = read_disassembly(a.disassembly)
    col = {h: i for i, h in enumerate(header)}
    if len(rows) != len(dis):
        print(f"error: the profile has {len(rows)} SASS instructions, the disassembly {len(dis)}: not the same "
              f"kernel build (compile the config the profiled launch took)", file=sys.stderr)
        return 1
    mismatched = [i for i, (r, d) in enumerate(zip(rows, dis)) if opcode(r[col["Source"]]) != opcode(d[2])]
    if mismatched:
        i = mismatched[0]
        print(f"error: {len(mismatched)} of {len(rows)} opcodes differ, first at {i}: profile "
              f"{rows[i][col['Source']].strip()!r}, disassembly {dis[i][2]!r}", file=sys.stderr)
        return 1

    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples_col, inst_col = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    per_line = collections.defaultdict(lambda: {"samples": 0, "instructions": 0, "sass": 0,
                                                "stalls": collections.Counter(), "opcodes": collections.Counter()})
    total = 0
    for r, (path, line, instruction) in zip(rows, dis):
        entry = per_line[(path, line)]
        samples = int(r[samples_col] or 0)
        total += samples
        entry["samples"] += samples
        entry["instructions"] += int(r[inst_col] or 0)
        entry["sass"] += 1
        entry["opcodes"][opcode(instruction)] += samples
        for h in stall_cols:
            entry["stalls"][h[6:]] += int(r[col[h]] or 0)
    source = open(a.source).read().split("\n") if a.source else None
    ranked = sorted(per_line.items(), key=lambda kv: -kv[1]["samples"])
    print(f"{len(rows)} SASS instructions matched opcode for opcode; {total} stall samples over "
          f"{len(per_line)} source lines\n")
    print(f"{'share':>6} {'cum':>6} {'line':>5} {'sass':>5}  top stalls; top opcodes | source")
    cum = 0
    report = []
    for (path, line), e in ranked[:a.top]:
        share = e["samples"] / (total or 1)
        cum += share
        stalls = ", ".join(f"{k} {v / (e['samples'] or 1):.0%}" for k, v in e["stalls"].most_common(3))
        ops = ", ".join(f"{k} {v / (e['samples'] or 1):.0%}" for k, v in e["opcodes"].most_common(2))
        own = source and "/triton/" not in path and 0 < line <= len(source)  # Triton's own: tl.sum, tl.sigmoid
        text = source[line - 1].strip()[:70] if own else f"({path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]})"
        print(f"{share:6.1%} {cum:6.1%} {line:5d} {e['sass']:5d}  {stalls}; {ops} | {text}")
        report.append({"line": line, "file": path, "share": share, "sass": e["sass"], "samples": e["samples"],
                       "instructions": e["instructions"], "stalls": dict(e["stalls"]), "source": text})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"total_samples": total, "lines": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
