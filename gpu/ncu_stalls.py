"""Where each kernel's warps wait, from Nsight Compute's per-instruction source page (issue 32's profiles).

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv
    python gpu/ncu_stalls.py SOURCE.csv

Per kernel launch in the report: the SASS length, the warp-stall samples and instructions executed, the stall
reasons' shares of the samples, and the opcodes' shares of samples and of instructions (an opcode with many more
samples than instructions is where warps wait: STS after a global load, BSYNC after a branch, ...).
"""

from __future__ import annotations

import collections
import csv
import sys


def sections(text: str):
    """(kernel name, CSV rows) for each kernel launch of the page."""
    out, current = [], None
    for line in text.split("\n"):
        if line.startswith('"Kernel Name"'):
            current = (line.split(",")[1].strip('"'), [])
            out.append(current)
        elif current is not None and line:
            current[1].append(line)
    return out


def opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # skip a predicate
    return word.split(".")[0]


def summarize(name: str, lines: list[str], index: int) -> str:
    header, *data = list(csv.reader(lines))
    col = {h: i for i, h in enumerate(header)}
    samples_col, inst_col = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = sum(int(d[samples_col] or 0) for d in data) or 1
    insts = sum(int(d[inst_col] or 0) for d in data) or 1
    by_op, inst_op, stalls = collections.Counter(), collections.Counter(), collections.Counter()
    for d in data:
        op = opcode(d[col["Source"]])
        by_op[op] += int(d[samples_col] or 0)
        inst_op[op] += int(d[inst_col] or 0)
        for h in stall_cols:
            stalls[h] += int(d[col[h]] or 0)
    return "\n".join([
        f"== [{index}] {name}: {len(data)} SASS instructions, {samples} stall samples, {insts} warp-instructions",
        "  stalls: " + ", ".join(f"{k[6:]} {v / samples:.0%}" for k, v in stalls.most_common(8)),
        "  opcodes (samples / instructions): " + ", ".join(
            f"{k} {v / samples:.0%}/{inst_op[k] / insts:.0%}" for k, v in by_op.most_common(14)),
    ])


def main() -> None:
    text = open(sys.argv[1]).read()
    for i, (name, lines) in enumerate(sections(text)):
        print(summarize(name, lines, i))


if __name__ == "__main__":
    main()
