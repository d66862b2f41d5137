"""Validation: the LM loss on held-out rows every ``train.eval_every`` steps, in both engines.

The held-out rows are a dataset's validation split (``nam data prepare --val-fraction``) or a dataset of their
own (``nam train --eval-data DIR``), read in one fixed order: evaluation ``k`` reads the same micro-batches as
evaluation 1, so two ``val_loss`` values of a run differ by the model alone. Each evaluation reads
``train.eval_tokens`` tokens over all data-parallel ranks (rounded up to whole micro-batches), at most one pass
over the held-out rows.

``val_loss`` is the LM loss alone (the MTP and auxiliary losses, whose scales are training choices, apart): the
mean over the micro-batches of each one's masked-mean loss. Micro-batches hold the same number of label tokens
except one row cut short by the end of the split, so this is the token mean up to that row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from nam_core.errors import DataError


@dataclass(frozen=True)
class HeldOut:
    """Held-out rows for an engine: ``batch_at(index, batch_size)`` (a pure function of the index, as the
    training data's), how many rows there are, and where they come from (for messages)."""

    batch_at: Callable[[int, int], dict]
    rows: int
    seq_len: int
    source: str

    def micro_batches(self, *, eval_tokens: int, micro_batch_size: int, dp: int = 1) -> int:
        """Micro-batches each of ``dp`` data-parallel ranks reads per evaluation: enough for ``eval_tokens``
        over all ranks, no more than the rows hold (DataError when not even one micro-batch per rank fits)."""
        per_round = micro_batch_size * dp  # rows one micro-batch on every rank reads
        fit = self.rows // per_round
        if fit < 1:
            raise DataError(
                f"the held-out rows ({self.source}) are {self.rows} of {self.seq_len} tokens; one evaluation "
                f"micro-batch on each of {dp} data-parallel rank(s) needs {per_round}",
                hint="hold out more documents (nam data prepare --val-fraction, larger), pass a larger "
                     "--eval-data, or lower train.micro_batch_size")
        return min(fit, math.ceil(eval_tokens / (per_round * self.seq_len)))

    def rank_batch(self, index: int, *, dp: int, dp_rank: int, micro_batches: int) -> int:
        """The held-out batch index of micro-batch ``index`` on data-parallel rank ``dp_rank``: rank ``r`` reads
        ``r * n .. r * n + n - 1``, so every rank reads rows no other rank reads."""
        return dp_rank * micro_batches + index


def mean_loss(total: float, count: float) -> float:
    """``val_loss`` from the summed per-micro-batch LM losses and their count (over every rank)."""
    return total / count if count else math.nan
