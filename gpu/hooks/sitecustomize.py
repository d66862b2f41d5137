"""Measurement hooks for GPU rounds, outside the project: put this folder first on PYTHONPATH (gpu/r12.sh).
Each hook is off unless its variable is set, and each wraps one function of an imported module when that module
is first imported (nothing of nam changes on disk).

  NAM_PROFILE_LOAD=PREFIX   the megatron engine's load_checkpoint run under cProfile in rank 0: PREFIX.txt (by
                            cumulative and own time) and PREFIX.prof
  NAM_PROFILE_ACTIVATE=PREFIX  the plugins' activation (``nam56r.run.activate``: the start-up's ``self-tests``
                            phase) under cProfile in rank 0: PREFIX.txt and PREFIX.prof
  NAM_PARALLEL_READ=1       Megatron's torch_dist load reads its files one thread per file (the experiment for
                            a change; torch's FileSystemReader reads them one after another)

Round 12 also had NAM_TARGETS_ON_GPU (the optimizer's load targets left on the GPU); nam does that itself since
(``checkpoint.targets_stay``), and NAM_PARALLEL_READ is nam's patch ``megatron-checkpoint-reads-in-turn``.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time


def _profiled(module, name: str, variable: str, lines: int = 70):
    """``module.name`` run under cProfile in rank 0, written to ``$variable``.txt (by cumulative and own time) and
    .prof."""
    import cProfile
    import pstats

    original = getattr(module, name)

    def profiled(*args, **kwargs):
        prefix = os.environ[variable]
        if os.environ.get("RANK", "0") != "0":
            return original(*args, **kwargs)
        profile, start = cProfile.Profile(), time.perf_counter()
        profile.enable()
        try:
            return original(*args, **kwargs)
        finally:
            profile.disable()
            profile.dump_stats(prefix + ".prof")
            import torch

            with open(prefix + ".txt", "w") as f:
                f.write(f"{name} {time.perf_counter() - start:.1f} s; torch threads {torch.get_num_threads()}; "
                        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}\n")
                pstats.Stats(profile, stream=f).sort_stats("cumulative").print_stats(lines)
                pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(50)

    setattr(module, name, profiled)


def _profile_load(module):
    _profiled(module, "load_checkpoint", "NAM_PROFILE_LOAD")


def _profile_activate(module):
    _profiled(module, "activate", "NAM_PROFILE_ACTIVATE", lines=120)


def _parallel_read(module):
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from torch.distributed.checkpoint.planner import LoadPlan

    original = module._get_filesystem_reader

    def get_reader(*args, **kwargs):
        reader = original(*args, **kwargs)
        sequential = reader.read_data

        def read_data(plan, planner):
            per_file = {}
            for item in plan.items:
                per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
            parts = [LoadPlan(items, plan.storage_data, plan.planner_data) for items in per_file.values()]
            start = time.perf_counter()
            with ThreadPoolExecutor(max(1, len(parts))) as pool:
                for done in [pool.submit(sequential, part, planner) for part in parts]:
                    done.result().wait()
            print(f"[hooks] read {len(parts)} files side by side in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr)
            finished = torch.futures.Future()
            finished.set_result(None)
            return finished

        reader.read_data = read_data
        return reader

    module._get_filesystem_reader = get_reader


HOOKS = {}
if os.environ.get("NAM_PROFILE_LOAD"):
    HOOKS.setdefault("nam_core.engine.megatron.checkpoint", []).append(_profile_load)
if os.environ.get("NAM_PROFILE_ACTIVATE"):
    HOOKS.setdefault("nam56r.run", []).append(_profile_activate)
if os.environ.get("NAM_PARALLEL_READ"):
    HOOKS.setdefault("megatron.core.dist_checkpointing.strategies.torch", []).append(_parallel_read)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    for hook in HOOKS[name]:
                        hook(module)
                    print(f"[hooks] {name}: {[h.__name__ for h in HOOKS[name]]}", file=sys.stderr)

                spec.loader.exec_module = exec_module
                return spec
        return None


if HOOKS:
    sys.meta_path.insert(0, _Finder())
