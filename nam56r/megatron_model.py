"""Moved to ``nam56r.megatron`` (issue 20): kept only for the callers owned by others this session
(cli/train.py, nam56r/run.py); switch them to ``from nam56r.megatron import ...`` and delete this module."""

from nam56r.megatron import NamMegatronModel, check_lowering, for_this_rank  # noqa: F401
