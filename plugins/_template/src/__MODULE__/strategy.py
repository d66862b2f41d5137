"""The __NAME__ indexer strategy: kind ``indexer``, protocol ``nam56r.backends.IndexerStrategy`` (its docstring
gives the shapes). As copied it is the built-in ``full`` selection, so a fresh copy activates and trains;
replace ``select`` with yours and test it against ``FullIndexer``."""

from __future__ import annotations

from nam56r.blocks.indexer import FullIndexer


class Strategy(FullIndexer):
    name = "__NAME__"
