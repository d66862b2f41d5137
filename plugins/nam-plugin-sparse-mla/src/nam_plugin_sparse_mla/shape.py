"""What the sparse-mla kernels take, in plain Python: the config check imports this without torch or Triton.

The kernels hold one query token's heads as the M side of ``tl.dot`` and one key row of ``dk`` channels as
the K side, so every width must be a power of two Triton can tile (``tl.arange`` needs powers of two, a dot
needs each side >= 16). Heads are padded up to ``head_block(h)`` with masks, so any head count up to
``MAX_HEADS`` works; top-k and the sequence length are free (masks handle the ragged last block).
"""

from __future__ import annotations

MIN_WIDTH, MAX_WIDTH = 16, 256
"""Key and value widths: powers of two in [16, 256]. 16: tl.dot's smallest side; 256: one row of registers
per head at dk=256 (DeepSeek-V3's 576 = 512 + 64 is not a power of two and is not taken)."""
MAX_HEADS = 128
"""Query heads per token: 128 = DeepSeek-V3's head count; NAM56R has 32, the tiny recipe 4."""


def head_block(h: int, *, least: int = 16) -> int:
    """Rows the kernels give the heads of one token: the next power of two >= max(h, least) (16: tl.dot's
    smallest side, for kernels whose dot has one token's heads alone as its M side)."""
    return max(least, 1 << (max(h, 1) - 1).bit_length())


def _pow2(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def _width_problem(name: str, d: int) -> str | None:
    if not (MIN_WIDTH <= d <= MAX_WIDTH and _pow2(d)):
        return f"{name} is {d}; the kernels take powers of two from {MIN_WIDTH} to {MAX_WIDTH}"
    return None


def shape_problem(dk: int, dv: int, h: int) -> str | None:
    """Why the attention kernels (and the sparse teacher, which takes the same q and kv) cannot take these
    widths, or None.

    ``dk`` key width (kv_lora_rank + qk_rope_dim), ``dv`` value width (kv_lora_rank), ``h`` query heads.
    """
    for name, d in (("key width dk = kv_lora_rank + qk_rope_dim", dk), ("value width dv = kv_lora_rank", dv)):
        problem = _width_problem(name, d)
        if problem is not None:
            return problem
    if dv > dk:
        return f"value width {dv} is wider than key width {dk} (the value is the key row's first dv channels)"
    if not 1 <= h <= MAX_HEADS:
        return f"{h} attention heads; the kernels take 1 to {MAX_HEADS}"
    return None


def index_shape_problem(d: int) -> str | None:
    """Why the index-score kernels cannot take index heads of width ``d`` (index_head_dim), or None.

    The index heads are looped over inside a program, so their count is free; ``d`` is the K side of the
    per-head dot. NAM56R: 64; the tiny recipe: 16.
    """
    return _width_problem("index head width index_head_dim", d)
