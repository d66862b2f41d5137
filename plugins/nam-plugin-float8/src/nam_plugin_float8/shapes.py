"""The one shape fact both the declarations (``plugin.py``) and the swap (``linears.py``) check, in a module of its
own so that neither imports the other for it."""

MULTIPLE = 16
"""FP8 GEMM operands need both dims divisible by 16 (``torch._scaled_mm``, ``torch._scaled_grouped_mm``;
torchao's auto filter skips other linears): ``nam_check_config`` refuses a selected projection or an expert
width that is not, before the run, and ``linears.convert`` refuses it again."""
