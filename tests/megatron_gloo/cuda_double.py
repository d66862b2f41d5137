"""A test double for the CUDA calls Megatron-Core 0.19 makes on its training path, so the megatron engine
runs on CPU processes over gloo (tests/test_megatron_engine_gloo.py). Imported first, in the worker
processes only; never by nam itself.

What it replaces, and why that is safe for the numbers the test compares: streams and events (Megatron
overlaps copies with them; on one CPU stream everything is already ordered), the CUDA RNG tracker and the CUDA
RNG state Megatron's activation checkpoint saves (nam56r has no dropout), device placement (tensor factories asked for ``cuda`` get the CPU), peak-memory counters
(reported as 0), and the dispatcher's device-to-host copy of split sizes (already on the host).
"""

import contextlib
import functools

import torch


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def synchronize(self):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()


class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()

    def add(self, *args, **kwargs):
        pass

    def is_initialized(self):
        return True

    def get_states(self):
        return {}

    def set_states(self, states):
        pass


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


def _type_as_cuda(original):
    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):  # Megatron's grad buffers check `param.type()` names a CUDA tensor
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") and ".cuda." not in name:
            return "torch.cuda." + name[len("torch."):]
        return name

    return wrapped


def install() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    torch.cuda.max_memory_allocated = lambda *args, **kwargs: 0
    torch.cuda.is_initialized = lambda: False
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _type_as_cuda(torch.Tensor.type)
    for name in ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "ones_like", "empty_like"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))

    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import token_dispatcher

    megatron_random._CUDA_RNG_STATE_TRACKER = _NoRngTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Megatron's activation checkpoint (train.recompute=layer or moe) saves and restores the CUDA RNG state
    # around its replay; there is no CUDA generator here (the CPU one it saves too is real)
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    token_dispatcher.maybe_move_tensor_to_cpu = (  # split sizes are None at EP 1
        lambda tensor, as_numpy=False, record_stream=False: tensor.numpy() if as_numpy and torch.is_tensor(tensor)
        else tensor)
