"""Benchmark: the activations ONE block of each NAM56R kind keeps for backward, under each recompute choice
(``train.recompute``): the constants ``nam56r.memory`` plans with (nam56r/activations.json is this script's
output on a GPU, checked in with its date and GPU).

The run is built as ``nam train`` builds it (``nam56r.run.build``: the recipe's plugins activated and
self-tested on this device, the patch lane applied, the backends), but not its model: one block of each part
at the recipe's width, in the training dtype:

* ``mamba``, ``moe``, ``dsa``, ``mla``: one ``Layer`` (norm, mixer, residual): the first of that kind in the
  resolved pattern;
* ``mtp``: one MTP depth: the next token's embedding lookup, ``MTPDepth``, its final norm and CE head;
* ``head``: the final norm and the CE head over the vocabulary (the loss of the main stack);
* ``embedding``: the token embedding, plus the n-gram hash embedding where the pattern has one.

Per part, choice and batch: one forward + backward to warm up (kernel builds, library workspaces), then one
measured. ``kept``: what the forward leaves allocated (allocated after it minus before it: the part's outputs
and everything saved for backward; the input is the previous part's output, counted there); ``backward_extra``:
the backward's peak above that; ``grads``: the parameter gradients the backward leaves. On CUDA the meter is the
caching allocator (``memory_allocated``, ``max_memory_allocated``). On the CPU (the tests' path check at toy
width) it counts the distinct tensors autograd saves plus the outputs (``saved_tensors_hooks``): a checkpoint
keeps its inputs outside autograd, so CPU numbers are a lower count and never constants.

    python bench/activations.py --batch 4 --json nam56r/activations.json             # one GPU, nam56r
    python bench/activations.py --recipe nam56r-tiny --device cpu --batch 2          # the path, toy width
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
import weakref
from pathlib import Path

import torch

PARTS = ("mamba", "moe", "dsa", "mla", "mtp", "head", "embedding")
"""What the plan sums: four layer kinds (the resolved pattern's M, E, D, A), the MTP depths, the head, the
embedding (``nam56r.memory.part_counts`` says how many of each a model has)."""
CHOICES = {"none": (), "mamba": ("mamba",), "mamba-scan": ("mamba-scan",), "moe": ("moe",),
           "attention": ("attention",), "layer": ("layer",)}
"""Each recompute kind alone (``nam_core.engine.config.RECOMPUTE_KINDS``); a set of kinds recomputes each of
its kinds' blocks as the kind alone does, so the plan combines these per part."""
LAYER_PARTS = {"mamba": "mamba", "moe": "moe", "dsa": "dsa", "mla": "mla"}
"""Part -> ``LayerSpec.kind`` of the layer it builds."""


def session(recipe: str, batch: int, device: str, overrides=()):
    """The built run of ``recipe`` at micro-batch ``batch`` on ``device`` with ``--set`` ``overrides`` (its
    plugins' self-tests and kernel builds run here, at that batch), without data or a model."""
    from nam56r.run import RunRequest, build, resolve
    from nam_core.engine.contract import engine_for
    from nam_core.host import PluginHost

    host = PluginHost()
    request = RunRequest(recipe=recipe, overrides=[f"train.micro_batch_size={batch}", *overrides], device=device,
                         env_plugins=False)
    run = resolve(request, host)
    engine = engine_for("local")
    return build(run, host, engine, engine.start(run.spec, dry_run=False), quiet=True, batches=lambda i, b: {})


class Parts:
    """The blocks, built once (``torch.manual_seed``), shared across choices and batches: ``recompute.apply``
    re-marks them per choice, as the engine marks the model."""

    def __init__(self, cfg, backends, *, device: str, dtype: torch.dtype):
        from torch import nn

        from nam56r.blocks.ngram_hash import NgramHashEmbedding
        from nam56r.model import Layer, MTPDepth
        from nam56r.pattern import resolve

        torch.manual_seed(0)
        self.cfg, self.backends = cfg, backends
        plan = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
        first = {}
        for spec in plan.layers:
            first.setdefault(spec.kind, spec)
        with torch.device(device):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
            nn.init.normal_(self.embed.weight, std=cfg.init_std)
            self.head = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden))
            if self.head is not None:
                nn.init.normal_(self.head, std=cfg.init_std)
            self.ngram = NgramHashEmbedding(cfg) if plan.ngram_head else None
            self.final_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
            self.layers = {part: Layer(first[kind], cfg, backends) for part, kind in LAYER_PARTS.items()
                           if kind in first}
            self.mtp = MTPDepth(cfg, backends) if cfg.mtp_depths else None
        for m in (self.embed, self.ngram, self.final_norm, self.mtp, *self.layers.values()):
            if m is not None:
                m.to(dtype=dtype)
        if self.head is not None:
            self.head.data = self.head.data.to(dtype)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head

    def shared(self) -> list[torch.Tensor]:
        """The parameters several parts use (the embedding table, the output head), whose gradients the model
        allocates once: a row's ``grad_bytes`` leaves them out, ``shared_grad_bytes`` counts them."""
        return [self.embed.weight] + ([self.head] if self.head is not None else [])

    def available(self) -> list[str]:
        return [p for p in PARTS if p in self.layers or (p == "mtp" and self.mtp is not None)
                or p in ("head", "embedding")]

    def modules(self, part: str) -> list:
        if part in self.layers:
            return [self.layers[part]]
        return {"mtp": [self.mtp], "head": [self.final_norm], "embedding": [self.ngram]}[part]

    def mark(self, kinds: tuple[str, ...]) -> None:
        from nam56r import recompute

        for m in (*self.layers.values(), self.mtp):
            if m is not None:
                recompute.apply(m, kinds)

    def _ce(self, h, labels):
        flat = labels.flatten()
        mask = torch.ones_like(flat, dtype=torch.float32)
        return self.backends.ce(h.flatten(0, 1), self.head_weight, flat, mask) / flat.numel()

    def runner(self, part: str, batch: int, device: str, dtype: torch.dtype):
        """(inputs, forward): the tensors made before the measured forward, and the forward, which returns the
        part's outputs (the next part's input, its losses) to backward from."""
        from nam56r.state import ForwardState

        cfg = self.cfg
        s, d = cfg.seq_len, cfg.hidden
        gen = torch.Generator(device=device).manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (batch, s), device=device, generator=gen)
        x = torch.randn(batch, s, d, device=device, dtype=dtype, generator=gen).requires_grad_()
        dout = torch.randn(batch, s, d, device=device, dtype=dtype, generator=gen)

        def with_aux(state, outs):
            return outs + [v for values in state.aux_losses.values() for v in values]

        if part in self.layers:
            layer = self.layers[part]

            def forward():
                state = ForwardState(seq_layout=(batch, s))
                return with_aux(state, [layer(x, state)])
        elif part == "mtp":
            def forward():
                state = ForwardState(seq_layout=(batch, s))
                h = self.mtp(x, self.embed(tokens), state)  # [b, s, d]: the next depth's input
                return with_aux(state, [h, self._ce(self.mtp.final_norm(h), tokens)])
        elif part == "head":
            def forward():
                return [self._ce(self.final_norm(x), tokens)]
        else:
            def forward():
                h = self.embed(tokens)
                return [h + self.ngram(tokens, None) if self.ngram is not None else h]
        return {"x": x, "dout": dout, "tokens": tokens}, forward


class CudaMeter:
    """The caching allocator's view: bytes allocated and the peak, relative to the start of a forward."""

    exact = True

    def start(self, exclude) -> None:
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def forward(self, run):
        return run()

    def kept(self, outs) -> int:
        torch.cuda.synchronize()
        self.after = torch.cuda.memory_allocated()
        return self.after - self.base

    def backward_extra(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.after


class SavedMeter:
    """The CPU's lower count: distinct storages autograd saves in the forward and still holds at its end (a branch
    the forward dropped frees its own), plus the outputs, less the parameters and inputs that existed before it.
    No peak."""

    exact = False

    def start(self, exclude) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.saved: list = []

    def _pack(self, t):
        if t.device.type != "meta":
            self.saved.append(weakref.ref(t))
        return t

    def forward(self, run):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            return run()

    def kept(self, outs) -> int:
        alive = [t for ref in self.saved if (t := ref()) is not None] + list(outs)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
        self.saved = []
        return sum(n for ptr, n in storages.items() if ptr not in self.exclude and ptr != 0)

    def backward_extra(self) -> None:
        return None


def measure(parts: Parts, part: str, choice: str, batch: int, *, device: str, dtype: torch.dtype, meter) -> dict:
    """One row: warm-up forward + backward, then the measured one (see the module docstring)."""
    parts.mark(CHOICES[choice])
    inputs, forward = parts.runner(part, batch, device, dtype)
    own = [p for m in parts.modules(part) if m is not None for p in m.parameters()]
    shared = parts.shared()
    params = own + shared
    row = {}
    for measured in (False, True):
        for t in (*params, inputs["x"]):
            t.grad = None
        if device == "cuda":
            gc.collect()  # nothing of the last row is left to be freed inside the measured forward
        meter.start(exclude=[*params, *inputs.values()])
        outs = meter.forward(forward)
        kept = meter.kept(outs)
        grads = [inputs["dout"] if o.shape == inputs["dout"].shape else torch.ones_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
        extra = meter.backward_extra()
        if measured:
            row = {"part": part, "choice": choice, "batch": batch, "kept_bytes": kept,
                   "kept_bytes_per_token": kept / (batch * parts.cfg.seq_len), "backward_extra_bytes": extra,
                   "grad_bytes": _grad_bytes(own), "shared_grad_bytes": _grad_bytes(shared)}
        del outs, grads
    for t in (*params, inputs["x"]):
        t.grad = None
    parts.mark(())
    return row


def _grad_bytes(params) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def run_all(parts: Parts, batches, *, device: str, dtype: torch.dtype, choices=tuple(CHOICES), say=print,
            on_part=lambda rows: None) -> list[dict]:
    """Every available part under every choice at every batch; ``on_part(rows)`` after each part (the JSON
    is written as it grows, so a run cut short keeps what it measured)."""
    meter = CudaMeter() if device == "cuda" else SavedMeter()
    rows = []
    for batch in batches:
        for part in parts.available():
            for choice in choices:
                t0 = time.perf_counter()
                row = measure(parts, part, choice, batch, device=device, dtype=dtype, meter=meter)
                rows.append(row)
                extra = row["backward_extra_bytes"]
                say(f"b{batch} {part:9s} {choice:10s} kept {row['kept_bytes'] / 2**20:9.1f} MiB"
                    + (f", backward +{extra / 2**20:.1f} MiB" if extra is not None else "")
                    + f"  ({time.perf_counter() - t0:.1f} s)")
                if device == "cuda":
                    torch.cuda.empty_cache()
            on_part(rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Markdown: MiB per sequence each part keeps at the largest micro-batch measured, per choice (``=``: the
    same as without recompute, within 0.5%), and the backward's peak above what it keeps (no recompute)."""
    batch = max(r["batch"] for r in rows)
    at = {(r["part"], r["choice"]): r for r in rows if r["batch"] == batch}
    choices = [c for c in CHOICES if any(k[1] == c for k in at)]
    out = [f"| part (MiB per sequence, MBS {batch}) | " + " | ".join(choices) + " | backward peak above, none |",
           "|---|" + "---|" * (len(choices) + 1)]
    for part in PARTS:
        if (part, "none") not in at:
            continue
        none = at[part, "none"]["kept_bytes"]
        cells = []
        for c in choices:
            kept = at.get((part, c), {}).get("kept_bytes")
            same = kept is not None and c != "none" and abs(kept - none) <= 0.005 * max(none, 1)
            cells.append("" if kept is None else "=" if same else f"{kept / batch / 2**20:,.1f}")
        extra = at[part, "none"]["backward_extra_bytes"]
        cells.append("" if extra is None else f"{extra / batch / 2**20:,.1f}")
        out.append(f"| {part} | " + " | ".join(cells) + " |")
    return out


def meta(cfg, spec, batches, device: str) -> dict:
    import importlib.metadata as md

    versions = {}
    for dist in ("nam-train", "mamba-ssm", "tilelang", "liger-kernel", "triton"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {"date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "versions": versions, "recipe": spec.recipe, "dtype": spec.train.dtype, "batches": list(batches),
            "shape": {"hidden": cfg.hidden, "seq_len": cfg.seq_len, "num_layers": cfg.num_layers},
            "backends": dict(spec.backends), "mamba_compile_prelude": cfg.mamba_compile_prelude,
            "meter": "torch.cuda.memory_allocated" if device == "cuda" else "saved tensors (a lower count)",
            "command": "python bench/activations.py " + " ".join(sys.argv[1:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="nam56r")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, nargs="+", default=[4],
                    help="micro-batches, largest first (the run is built at the first: its kernels are built); two "
                         "or more give each constant an intercept (nam56r.memory.Line), one a line through 0")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--choices", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override, as nam train --set takes it (e.g. mamba_compile_prelude=false)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--show", type=Path, default=None, metavar="JSON", help="print the table of a written JSON")
    args = ap.parse_args()
    if args.show:
        data = json.loads(args.show.read_text())
        m = data["meta"]
        print(f"{m['recipe']} on {m['gpu']}, {m['date']}, {m['dtype']}, meter {m['meter']}\n")
        print("\n".join(summary(data["rows"])))
        return 0

    t0 = time.perf_counter()
    built = session(args.recipe, args.batch[0], args.device, args.overrides)
    spec, cfg = built.spec, built.spec.model
    dtype = getattr(torch, spec.train.dtype)
    parts = Parts(cfg, built.backends, device=args.device, dtype=dtype)
    print(f"{spec.recipe}: hidden {cfg.hidden}, seq {cfg.seq_len}, {spec.train.dtype}, {args.device}; "
          f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    info = meta(cfg, spec, args.batch, args.device)

    def write(rows):
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")

    available = set(parts.available())
    keep = [p for p in args.parts if p in available]
    parts.available = lambda: keep
    rows = run_all(parts, args.batch, device=args.device, dtype=dtype, choices=tuple(args.choices),
                   say=lambda line: print(line, flush=True), on_part=write)
    print("\n" + "\n".join(summary(rows)))
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.1f} s" + (f"; wrote {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
