"""N-gram hash embedding: the last 2 and 3 token ids, hashed into 16 small tables, added to the token embedding.

For every order ``n`` in ``cfg.ngram_orders`` there are ``cfg.ngram_heads`` tables (NAM56R: 2 orders x 8 heads
= 16 tables); each table ``j`` has its own prime size ``p_j``, odd multipliers ``m_{j,k}`` and an XOR offset
``b_j``, so two n-grams that collide in one table almost never collide in the others::

    h_j(t) = ( XOR_{k < n_j} ids[t-k] * m_{j,k} )  XOR  b_j   mod  p_j        # int64
    e_t    = concat_j  table[start_j + h_j(t)]                                # [T * dim] = 16 * 16 = 256
    out_t  = out_proj(e_t)                                                    # [hidden], added to tok_emb

Positions ``t - k`` before the start of the row, or before the start of the token's own document when the row
packs several documents (``segment_ids``), read as the pad id 0, so an n-gram never spans two documents.
(The layout follows DatasunriseOU/cppmega's input-side hash embedding; Engram, arXiv 2601.07372, is the
published design it simplifies. cppmega hashes across document boundaries; here that is fixed.)

The 16 tables live in one ``nn.Embedding`` of ``sum_j p_j`` rows; ``start_j`` is table ``j``'s first row.
``out_proj`` starts at zero, so a model with this module computes exactly what it computes without it until
the optimizer moves ``out_proj`` (the table gets no gradient on step 0 for the same reason).

The hash constants come from a ``torch.Generator`` with a fixed seed, so every build hashes identically, and
they are persistent buffers, so a checkpoint carries the constants its table was trained with.
"""

from __future__ import annotations

import torch
from torch import nn

from nam56r.config import NAM56RConfig

HASH_SEED = 56
"""Seed of the hash constants (56 for NAM56R; any constant works). Changing it rehashes every n-gram."""


def is_prime(n: int) -> bool:
    """Trial division; table sizes are ~5e5 (NAM56R), so at most ~700 divisions."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def primes_from(start: int, count: int) -> list[int]:
    """The ``count`` smallest primes >= ``start`` (distinct and ascending, so the choice is deterministic)."""
    primes, n = [], max(start, 2)
    while len(primes) < count:
        if is_prime(n):
            primes.append(n)
        n += 1
    return primes


def hash_constants(num_tables: int, max_order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Odd multipliers ``[T, max_order]`` and XOR offsets ``[T]``, int64 on CPU, drawn from ``HASH_SEED``.

    Both are < 2**31, so ``id * m`` stays below 2**63 for any id < 2**32 (NAM56R's vocabulary is 2**17).
    Built on CPU explicitly so the draw is the same when the module is constructed under the meta device.
    """
    g = torch.Generator(device="cpu").manual_seed(HASH_SEED)
    mult = torch.randint(1, 2**31, (num_tables, max_order), generator=g, dtype=torch.int64, device="cpu") | 1
    xor = torch.randint(0, 2**31, (num_tables,), generator=g, dtype=torch.int64, device="cpu")
    return mult, xor


def positions_in_document(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` offset of each token from the first token of its document (a new document starts wherever
    ``segment_ids`` changes from the previous position, and at position 0)."""
    b, s = segment_ids.shape
    idx = torch.arange(s, device=segment_ids.device).expand(b, s)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    doc_start = torch.where(starts, idx, 0).cummax(dim=1).values  # [b, s] index of the document's first token
    return idx - doc_start


class NgramHashEmbedding(nn.Module):
    def __init__(self, cfg: NAM56RConfig):
        super().__init__()
        orders = tuple(cfg.ngram_orders)
        self.table_orders = [n for n in orders for _ in range(cfg.ngram_heads)]  # order of table j, order-major
        self.primes = primes_from(cfg.ngram_table, len(self.table_orders))
        self.max_order = max(orders)
        t, dim = len(self.table_orders), cfg.ngram_dim

        self.table = nn.Embedding(sum(self.primes), dim)  # NAM56R: ~8.0M rows x 16
        self.out_proj = nn.Linear(t * dim, cfg.hidden, bias=False)
        # Every buffer is written by reset_parameters, so a meta-built module is whole again after to_empty.
        # Hash constants: saved with the weights.
        self.register_buffer("hash_mult", torch.empty(t, self.max_order, dtype=torch.int64))
        self.register_buffer("hash_xor", torch.empty(t, dtype=torch.int64))
        # Pure functions of the config: not saved.
        self.register_buffer("table_prime", torch.empty(t, dtype=torch.int64), persistent=False)
        self.register_buffer("table_start", torch.empty(t, dtype=torch.int64), persistent=False)
        self.register_buffer("uses_shift", torch.empty(self.max_order, t, dtype=torch.bool), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the weights and write every buffer; call it after ``to_empty`` on a meta-built module.

        The buffers are computed on CPU (``hash_constants`` draws from a CPU generator) and copied in, which
        is a no-op on the meta device.
        """
        # Unit-variance rows (nn.Embedding's default): out_proj then sees features of the scale a Linear expects.
        nn.init.normal_(self.table.weight, std=1.0)
        nn.init.zeros_(self.out_proj.weight)
        mult, xor = hash_constants(len(self.table_orders), self.max_order)
        starts = [sum(self.primes[:j]) for j in range(len(self.primes))]
        # uses_shift[k, j]: table j (order n_j) mixes ids[t - k] in, i.e. k < n_j.
        uses_shift = [[k < n for n in self.table_orders] for k in range(self.max_order)]
        with torch.no_grad():
            self.hash_mult.copy_(mult)
            self.hash_xor.copy_(xor)
            self.table_prime.copy_(torch.tensor(self.primes, dtype=torch.int64, device="cpu"))
            self.table_start.copy_(torch.tensor(starts, dtype=torch.int64, device="cpu"))
            self.uses_shift.copy_(torch.tensor(uses_shift, device="cpu"))

    def buckets(self, ids: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``h_j(t)`` for ``ids [b, s]``: int64 ``[b, s, T]``, each in ``[0, p_j)``."""
        ids = ids.long()
        b, s = ids.shape
        if segment_ids is None:
            pos = torch.arange(s, device=ids.device).expand(b, s)  # the row is one document
        else:
            pos = positions_in_document(segment_ids)
        mix = torch.zeros(b, s, len(self.table_orders), dtype=torch.int64, device=ids.device)  # [b, s, T]
        for k in range(self.max_order):
            # ids[t - k], or the pad id 0 where t - k falls before the document start (roll's wrap included).
            prev = torch.where(pos >= k, ids.roll(k, dims=1), 0)  # [b, s]
            term = prev.unsqueeze(-1) * self.hash_mult[:, k]  # [b, s, T]
            mix ^= torch.where(self.uses_shift[k], term, 0)  # tables of order <= k stop at shift k - 1
        return (mix ^ self.hash_xor) % self.table_prime

    def forward(self, ids: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s = ids.shape
        rows = self.buckets(ids, segment_ids) + self.table_start  # [b, s, T] rows of the unified table
        e = self.table(rows).reshape(b, s, -1)  # [b, s, T * dim]
        return self.out_proj(e)  # [b, s, hidden]
