"""lemyx's options and the rules between them: declared once, read by the declaration (``plugin.py``), the
strategy (``strategy.py``) and the kernel (``kernel.py``). Pure Python, so ``nam plugins list`` reads the
declaration without torch or Triton."""

from __future__ import annotations

from dataclasses import dataclass

from nam_core.options import Option

NAME = "lemyx"
TRITON, REFERENCE = "triton", "reference"
BACKENDS = (TRITON, REFERENCE)
HEAD_SUM, PER_HEAD = "head-sum", "per-head"
TARGETS = (HEAD_SUM, PER_HEAD)
"""The KL teacher: the attention distribution summed over heads (DeepSeek-V3.2), or each head's own."""
DEFAULT_WARMUP_STEPS = 1000
"""DeepSeek-V3.2 trains the indexer densely for its first 1000 steps."""

OPTIONS = (
    Option("warmup_steps", int, DEFAULT_WARMUP_STEPS, "optimizer steps of dense attention + indexer KL before the "
           "hand-over to sparse (DeepSeek-V3.2 trains the indexer densely for its first 1000 steps)", min=0),
    Option("backend", str, None, "triton: the fused kernel; reference: the unfused pure-PyTorch path; unset: "
           "triton on a CUDA device, reference on a CPU", choices=BACKENDS),
    Option("target", str, HEAD_SUM, "the KL teacher: head-sum (DeepSeek-V3.2) or per-head (reference "
           "backend only)", choices=TARGETS),
    Option("freeze_main", bool, False, "train only the DSA indexers during the warm-up (local engine)"),
    Option("sparse", str, "full", "the indexer strategy that runs after the warm-up (set by requesting it: "
           "--plugins index-cache)"),
)
"""What ``--set lemyx.<option>=VALUE`` takes (``PLUGIN.options``)."""


@dataclass(frozen=True)
class Options:
    """``lemyx.*`` options after parsing; ``backend`` already resolved for the device."""

    warmup_steps: int = DEFAULT_WARMUP_STEPS
    backend: str = REFERENCE
    backend_source: str = "default for cpu"
    target: str = HEAD_SUM
    freeze_main: bool = False
    sparse: str = "full"


def options_for(values, device: str) -> Options:
    """The host-parsed ``lemyx.*`` values (``nam_core.options.OptionValues``) with the backend resolved for
    ``device`` (``cpu`` or ``cuda``): never chosen by what is installed; unset, it is ``reference`` on a CPU
    device and ``triton`` on a CUDA device (whether the kernel can run there is the config check's business)."""
    if values.backend is not None:
        backend, source = values.backend, "set by you"
    else:
        backend, source = (TRITON if device == "cuda" else REFERENCE), f"default for {device}"
    return Options(warmup_steps=values.warmup_steps, backend=backend, backend_source=source, target=values.target,
                   freeze_main=values.freeze_main, sparse=values.sparse)


def option_problem(options: Options) -> tuple[str, str, str] | None:
    """``(option, found, expected)`` for a combination of options that cannot run, or None."""
    if options.sparse == NAME:
        return f"{NAME}.sparse", options.sparse, "another indexer strategy (full, index-cache, ...)"
    if options.backend == TRITON and options.target != HEAD_SUM:
        return (f"{NAME}.target", options.target,
                f"{HEAD_SUM} with the fused kernel (per-head runs on {NAME}.backend={REFERENCE} only)")
    return None


def shape_problem(dk: int, dv: int, di: int) -> str | None:
    """Why the fused kernel cannot take these head widths, or None (MLA key/value width, indexer head dim)."""
    for name, d in (("MLA key width (kv_lora_rank + qk_rope_dim)", dk), ("MLA value width (kv_lora_rank)", dv),
                    ("indexer head dim", di)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"{name} {d} (the kernel takes powers of two from 16 to 256)"
    if dv > dk:
        return f"value width {dv} wider than key width {dk}"
    return None
