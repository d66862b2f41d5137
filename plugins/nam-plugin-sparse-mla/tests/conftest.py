"""Fixture of the plugin's CPU tests: ``run_interpreted_bf16``, Triton's interpreter with bf16 dots fixed."""

from __future__ import annotations

import pytest

BF16_DOT = '''
import numpy as _np
import triton.language as _tl
from triton.runtime import interpreter as _interp

def _bf16_as_fp32(x):
    if x.dtype.scalar != _tl.bfloat16:
        return x
    return _interp.TensorHandle(_interp._convert_float(x.data, _tl.bfloat16, _tl.float32, None).view(_np.float32),
                                _tl.float32)

_create_dot = _interp.InterpreterBuilder.create_dot
_interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: _create_dot(
    self, _bf16_as_fp32(a), _bf16_as_fp32(b), d, *rest)
'''
"""Prepended to an interpreted snippet. Triton's interpreter (3.6 to 3.9) keeps a bf16 tensor as its uint16
bit pattern and its ``create_dot`` hands those integers to ``np.matmul`` (off by ~1e10); loads, stores and
casts are right. The patch upcasts a dot's bf16 operands to fp32 first (exact), so the bf16 paths of the
kernels (the hi/lo split dots) run under the interpreter as on the GPU, up to fp32 summation order."""


@pytest.fixture(scope="module")
def run_interpreted_bf16(run_interpreted):
    """``run_interpreted`` with ``BF16_DOT`` before the snippet."""
    return lambda code: run_interpreted(BF16_DOT + code)
