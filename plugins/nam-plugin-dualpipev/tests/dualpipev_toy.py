"""A toy model split V-shape over gloo (or NCCL) processes, and the single-process reference it must equal.

Not a test file: test_executor_gloo.py and test_executor_nccl_gpu.py import it, and torch.multiprocessing
spawns ``worker`` from it (a module on sys.path, so the spawned processes can import it by name).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

H = 8  # hidden width of the toy stages
SHAPE = (3, 2, H)  # [s, b, h]: what every stage hands on
SEED = 1234
RTOL, ATOL = 1e-5, 1e-6  # fp32: only the order of the micro-batch gradient sums differs from the reference


def build_stages(n_stages: int, seed: int = SEED) -> list[nn.Module]:
    """The model's stages in order, fp32, the same weights in every process."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(n_stages)]


def make_batches(num_microbatches: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fresh random inputs and targets, one ``[s, b, h]`` pair per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)) for _ in range(num_microbatches)]
    return [x for x, _ in pairs], [t for _, t in pairs]  # drawn in pairs: fewer micro-batches, the same first ones


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def reference(pp: int, num_microbatches: int, seed: int, *, scale: float = 1.0, device: str = "cpu") -> dict:
    """All 2 x pp stages in sequence in one process: the loss of each micro-batch, and the gradients of the
    backward of their sum (times ``scale``), by stage; on the CPU whatever ``device`` computed them."""
    stages = [stage.to(device) for stage in build_stages(2 * pp)]
    inputs, targets = make_batches(num_microbatches, seed)
    losses = []
    for x, t in zip(inputs, targets):
        x = x.to(device)
        for stage in stages:
            x = stage(x)
        losses.append(mse(x, t.to(device)))
    (torch.stack(losses).sum() * scale).backward()
    return {"losses": [l.detach().cpu() for l in losses],
            "grads": {(i, n): p.grad.cpu() for i in range(2 * pp) for n, p in stages[i].named_parameters()}}


# --- the distributed side --------------------------------------------------------------------------------


class ToyChunk(nn.Module):
    """A stage with Megatron's chunk interface: ``set_input_tensor`` then ``forward(batch)``; the last stage
    returns its loss, as Megatron's last stage does when given labels."""

    def __init__(self, stage: nn.Module, *, first: bool, last: bool):
        super().__init__()
        self.stage, self.first, self.last = stage, first, last
        self.input_tensor = None

    def set_input_tensor(self, x):
        self.input_tensor = x

    def forward(self, batch: dict) -> torch.Tensor:
        y = self.stage(batch["x"] if self.first else self.input_tensor)
        return mse(y, batch["target"]) if self.last else y


class ToyConfig:
    """The fields of Megatron's TransformerConfig the adapter reads, and a finalize hook that counts calls."""

    hidden_size = H
    pipeline_dtype = torch.float32
    num_moe_experts = None
    mtp_num_layers = None

    def __init__(self):
        self.finalized = 0

    @staticmethod
    def grad_scale_func(loss):
        return loss * 2.0  # a visible loss scale: the gradients must come out doubled

    def finalize_model_grads_func(self, model):
        self.finalized += 1


def run_scenario(rank: int, pp: int, *, name: str, microbatches: int, seed: int, via: str = "executor",
                 train: bool = True, swap_chunks_on: int | None = None, device: str = "cpu") -> dict:
    """One DualPipeV step of this rank, through ``run_dualpipev`` or (``via="adapter"``) the engine-facing
    ``DualPipeV``; returns its losses (rank 0) and the gradients of its two stages."""
    from nam_plugin_dualpipev.engine import DualPipeV
    from nam_plugin_dualpipev.executor import run_dualpipev

    stages = [stage.to(device) for stage in build_stages(2 * pp)]
    mine = [rank, 2 * pp - 1 - rank]
    if swap_chunks_on == rank:
        mine.reverse()  # a mis-built V: the comparison must catch it
    inputs, targets = make_batches(microbatches, seed)
    inputs, targets = [x.to(device) for x in inputs], [t.to(device) for t in targets]
    chunks = [stages[i] for i in mine]
    if via == "adapter":
        config = ToyConfig()
        model = [ToyChunk(stages[i], first=i == 0, last=i == 2 * pp - 1) for i in mine]
        for chunk in model:
            chunk.config = config
        data = iter([(i, {"x": inputs[i], "target": targets[i]}) for i in range(microbatches)])

        def forward_step(data_iterator, chunk):
            _, batch = next(data_iterator)
            return chunk(batch), lambda loss: (loss, {"lm_loss": loss.detach()})

        logs = DualPipeV(group=dist.group.WORLD)(
            forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=microbatches,
            seq_length=SHAPE[0], micro_batch_size=SHAPE[1], forward_only=not train)
        losses = [entry["lm_loss"].cpu() for entry in logs]
        extra = {"finalized": config.finalized}
    else:
        losses = run_dualpipev(chunks, inputs=inputs if rank == 0 else None, num_microbatches=microbatches,
                               loss_fn=lambda y, i: mse(y, targets[i]), shape=SHAPE, dtype=torch.float32,
                               train=train)
        losses = [loss.cpu() for loss in losses]
        extra = {}
    grads = {(i, n): (None if p.grad is None else p.grad.cpu())
             for i in (rank, 2 * pp - 1 - rank) for n, p in stages[i].named_parameters()}
    return {"losses": losses, "grads": grads, **extra}


def worker(rank: int, pp: int, init_file: str, out_dir: str, scenarios: list[dict], backend: str = "gloo") -> None:
    """Entry point of each spawned process: every scenario in turn, results to ``out_dir/rank<r>.pt``.
    ``backend="nccl"``: one GPU per rank, cuda:<rank>."""
    device = "cpu"
    options = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        options["device_id"] = torch.device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=pp,
                            timeout=datetime.timedelta(seconds=60), **options)  # a deadlock fails, not hangs
    try:
        results = {s["name"]: run_scenario(rank, pp, **s, device=device) for s in scenarios}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# --- the test side -------------------------------------------------------------------------------------------


def spawn(out: Path, pp: int, scenarios: list[dict], backend: str = "gloo") -> dict:
    """Run ``scenarios`` on ``pp`` processes; per scenario: rank 0's losses and every rank's gradients."""
    mp.spawn(worker, args=(pp, str(out / "init"), str(out), scenarios, backend), nprocs=pp, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(pp)]
    merged = {}
    for s in scenarios:
        name = s["name"]
        merged[name] = {"losses": ranks[0][name]["losses"],
                        "grads": {k: v for r in ranks for k, v in r[name]["grads"].items()},
                        "finalized": [r[name].get("finalized") for r in ranks],
                        "other_ranks_losses": [r[name]["losses"] for r in ranks[1:]]}
    return merged


def assert_matches(run: dict, ref: dict) -> None:
    """Each micro-batch's loss and every parameter gradient, within RTOL / ATOL."""
    assert len(run["losses"]) == len(ref["losses"]), (len(run["losses"]), len(ref["losses"]))
    for i, (got, want) in enumerate(zip(run["losses"], ref["losses"])):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"loss of micro-batch {i}")
    assert run["grads"].keys() == ref["grads"].keys()
    for key, want in ref["grads"].items():
        torch.testing.assert_close(run["grads"][key], want, rtol=RTOL, atol=ATOL, msg=f"gradient of stage {key}")
