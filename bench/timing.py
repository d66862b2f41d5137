"""What every benchmark here measures the same way: CUDA-event time and peak memory of one training step, and
CUDA-event time of single kernel launches."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], *, warmup: int, iters: int) -> float:
    """Median CUDA-event milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_and_peak(step: Callable[[], None], clear: Callable[[], None], *, warmup: int,
                  iters: int) -> tuple[float, float]:
    """Median milliseconds of ``step()`` over ``iters`` runs after ``warmup``, and its peak GiB above what is
    allocated before it (after ``clear()`` drops the last step's gradients). ``step`` runs forward + backward."""
    ms = median_ms(step, warmup=warmup, iters=iters)
    clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


class TimedLaunches:
    """Wraps a kernel launcher: while ``switch["on"]``, each launch is bracketed by CUDA events appended to
    ``log`` (read them after a synchronize); otherwise it only launches. For timing the kernels inside a larger
    call, such as mamba-ssm's three MIMO kernels inside a scan forward + backward."""

    def __init__(self, kernel, log: list, switch: dict):
        self.kernel, self.log, self.switch = kernel, log, switch

    def __call__(self, *args):
        if not self.switch["on"]:
            return self.kernel(*args)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.kernel(*args)
        end.record()
        self.log.append((start, end))
        return out
