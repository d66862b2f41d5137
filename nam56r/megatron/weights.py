"""nam56r's state dict in Megatron's names: every nam parameter renamed (and sliced: pipeline stage, experts)
for one rank's ``NamHybridModel``, CPU-testable. The local and the megatron engine start from the same weights."""

from __future__ import annotations

from typing import Mapping

import torch

from nam_core.errors import ConfigError, NamError

KIND = {"M": "mamba", "E": "moe", "A": "mla", "D": "dsa"}
"""nam layer symbol -> the kind ``nam_state_to_megatron`` maps."""


def _mtp_positions(mtp_pattern: str) -> tuple[int, int]:
    """Stack positions of the MLA and the MLP layer inside one MTP depth (nam's MTPDepth: attention, MLP)."""
    if sorted(mtp_pattern) != sorted("+-"):
        raise ConfigError(f"MTP depth pattern {mtp_pattern!r}: the weight map knows nam's MTPDepth ('+-') only",
                          hint="the lowering's MTP_DEPTH and nam56r.model.MTPDepth must change together")
    return mtp_pattern.index("+"), mtp_pattern.index("-")


def nam_state_to_megatron(
    state: Mapping[str, torch.Tensor],
    kinds: tuple[str, ...],
    *,
    mtp_pattern: str = "+-",
    ep_rank: int = 0,
    ep_size: int = 1,
    first: int = 0,
    stop: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    mtp_process: bool = True,
) -> dict[str, torch.Tensor]:
    """nam56r.model.NAM56R's ``state_dict`` renamed (and sliced) for one rank's ``NamHybridModel``.

    ``kinds``: per stack layer, ``mamba``/``moe``/``mla``/``dsa``; this rank holds layers ``[first, stop)``
    and, of every MoE layer, experts ``[ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)``. Embedding,
    n-gram and structure tables go to the first stage; final norm, head and MTP to the last (the last stage
    keeps its own copy of the token embedding for MTP, as HybridModel does). Unknown keys raise.
    """
    stop = len(kinds) if stop is None else stop
    attn_pos, mlp_pos = _mtp_positions(mtp_pattern)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        if head == "embed":
            if pre_process or mtp_process:
                out[f"embedding.word_embeddings.{rest}"] = value
        elif head in ("ngram", "structure"):
            if pre_process:
                out[key] = value
        elif head in ("final_norm", "head"):
            if post_process:
                out["output_layer.weight" if head == "head" else key] = value
        elif head == "layers":
            index, _, name = rest.partition(".")
            i = int(index)
            if first <= i < stop:
                out.update(_layer_weights(kinds[i], f"decoder.layers.{i - first}.", name, value, ep_rank, ep_size))
        elif head == "mtp":
            if mtp_process:
                depth, _, name = rest.partition(".")
                out.update(_mtp_weights(int(depth), name, value, attn_pos, mlp_pos))
        else:
            raise NamError(f"nam parameter {key!r} has no place in the Megatron model",
                           hint="nam_state_to_megatron must learn it (nam56r/megatron/weights.py)")
    return out


def _layer_weights(kind: str, prefix: str, name: str, value: torch.Tensor, ep_rank: int, ep_size: int) -> dict:
    norm = {"mamba": "norm", "moe": "pre_mlp_layernorm", "mla": "input_layernorm", "dsa": "input_layernorm"}
    if name.startswith("norm."):
        return {prefix + norm[kind] + name[len("norm"):]: value}
    sub = name[len("mixer."):]
    if kind == "mamba":
        return {f"{prefix}mixer.block.{sub}": value}
    if kind in ("mla", "dsa"):
        return {f"{prefix}self_attention.block.{sub}": value}
    if sub in ("w_gate_up", "w_down"):  # [E, 2f, d] / [E, d, f] -> this rank's experts, stacked (ExpertsSlot)
        local = value.shape[0] // ep_size
        return {f"{prefix}mlp.experts.{sub}": value[ep_rank * local:(ep_rank + 1) * local]}
    shared = {"shared.w_gate_up.weight": "shared_experts.linear_fc1.weight",
              "shared.w_down.weight": "shared_experts.linear_fc2.weight", "router.weight": "router.weight"}
    if sub not in shared:
        raise NamError(f"MoE parameter {name!r} has no place in Megatron's MoELayer",
                       hint="nam_state_to_megatron must learn it (nam56r/megatron/weights.py)")
    return {f"{prefix}mlp.{shared[sub]}": value}


def _mtp_weights(depth: int, name: str, value: torch.Tensor, attn_pos: int, mlp_pos: int) -> dict:
    prefix = f"mtp.layers.{depth}."
    inner = f"{prefix}mtp_model_layer.layers."
    if name == "eh_proj.weight":
        # nam projects cat(norm_h(h), norm_e(e)); Megatron cat(enorm(e), hnorm(h)): swap the column halves.
        h = value.shape[1] // 2
        return {prefix + name: torch.cat([value[:, h:], value[:, :h]], dim=1)}
    renamed = {"norm_h.weight": prefix + "hnorm.weight", "norm_e.weight": prefix + "enorm.weight",
               "attn.norm.weight": f"{inner}{attn_pos}.input_layernorm.weight",
               "mlp_norm.weight": f"{inner}{mlp_pos}.pre_mlp_layernorm.weight",
               "mlp.w_gate_up.weight": f"{inner}{mlp_pos}.mlp.linear_fc1.weight",
               "mlp.w_down.weight": f"{inner}{mlp_pos}.mlp.linear_fc2.weight",
               "final_norm.weight": f"mtp_norms.{depth}.weight"}
    if name in renamed:
        return {renamed[name]: value}
    if name.startswith("attn.mixer."):
        return {f"{inner}{attn_pos}.self_attention.block.{name[len('attn.mixer.'):]}": value}
    raise NamError(f"MTP parameter {name!r} has no place in Megatron's MTP layer",
                   hint="nam_state_to_megatron must learn it (nam56r/megatron/weights.py)")


def megatron_state_to_nam(tensors: Mapping[str, torch.Tensor], cfg, *,
                          names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """A megatron-engine checkpoint's model tensors (whole: every expert, every layer under its global number;
    ``nam_core.engine.megatron.checkpoint.model_tensors``) under nam56r's names, each the tensor nam56r's
    ``NAM56R.state_dict()`` holds. The inverse of ``nam_state_to_megatron`` at one rank holding everything: each
    nam name's Megatron name is found by mapping it forward (a meta tensor, nothing allocated), and the value is
    mapped forward too, which gives it back: every change the map makes is its own inverse (a rename, or
    ``eh_proj``'s swap of two equal column halves). Every nam tensor must be found and every Megatron tensor used
    (``_extra_state`` aside), or NamError names the difference. ``names``: the nam tensors to read (default
    every one of ``state_dict()``; the trainable parameters for optimizer state, which buffers have none)."""
    from nam56r.model import build_model
    from nam56r.pattern import resolve

    from nam56r.megatron.lowering import MTP_DEPTH

    kinds = tuple(KIND[layer.symbol] for layer in resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks).layers)
    place = dict(kinds=kinds, mtp_pattern=MTP_DEPTH)
    out, used = {}, set()
    metas = build_model(cfg, device="meta").state_dict()
    for name, meta in ((n, metas[n]) for n in (names if names is not None else metas)):
        (megatron_name,) = nam_state_to_megatron({name: meta}, **place)
        if megatron_name not in tensors:
            hint = ("a checkpoint of Transformer Engine's grouped experts (te.experts=grouped) keeps one weight per "
                    "expert, which this map does not read back" if ".experts." in megatron_name else
                    "the checkpoint was written by another model or nam version")
            raise NamError(f"the megatron checkpoint has no {megatron_name!r} (nam's {name!r})", hint=hint)
        ((_, value),) = nam_state_to_megatron({name: tensors[megatron_name]}, **place).items()
        out[name] = value.contiguous()
        used.add(megatron_name)
    unread = sorted(k for k in tensors if k not in used and not k.rpartition(".")[2].startswith("_extra_state"))
    if unread:
        raise NamError(f"the megatron checkpoint has tensors nam56r has no place for: {unread[:6]}",
                       hint="nam_state_to_megatron must learn them (nam56r/megatron/weights.py)")
    return out


def for_this_rank(model, nam_tensors: Mapping[str, torch.Tensor], lowering, pg_collection) -> dict:
    """``nam_tensors`` (keyed by nam56r parameter names: weights, or their gradients) renamed and sliced for
    one rank's (unwrapped) NamHybridModel: its pipeline stage, its experts."""
    numbers = [layer.layer_number for layer in model.decoder.layers]  # 1-based, global
    kinds = tuple(KIND[layer["nam"]] for layer in lowering.layers)
    mapped = nam_state_to_megatron(
        nam_tensors, kinds, mtp_pattern=lowering.mtp_pattern or "+-", ep_rank=pg_collection.ep.rank(),
        ep_size=pg_collection.ep.size(), first=numbers[0] - 1 if numbers else 0,
        stop=numbers[-1] if numbers else 0, pre_process=model.pre_process, post_process=model.post_process,
        mtp_process=model.mtp_process)
    return per_expert(mapped) if lowering.config_args.get("moe_grouped_gemm") else mapped


GROUPED = {"w_gate_up": "linear_fc1", "w_down": "linear_fc2"}
"""nam's stacked expert weight -> the ``TEGroupedMLP`` projection that holds one ``weight<i>`` per local expert."""


def per_expert(mapped: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mapped`` with each stacked ``...mlp.experts.w_gate_up [E_local, 2f, d]`` / ``w_down [E_local, d, f]``
    split into Megatron's ``TEGroupedMLP`` names, ``...mlp.experts.linear_fc1.weight<i> [2f, d]`` and
    ``linear_fc2.weight<i> [d, f]`` (local expert ``i``; the same ``[gate ; up]`` rows)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in mapped.items():
        prefix, _, name = key.rpartition(".")
        if prefix.endswith(".mlp.experts") and name in GROUPED:
            out.update({f"{prefix}.{GROUPED[name]}.weight{i}": value[i] for i in range(value.shape[0])})
        else:
            out[key] = value
    return out


def load_nam_weights(model, nam_state: Mapping[str, torch.Tensor], lowering, pg_collection) -> None:
    """Copy a nam56r state dict into one rank's (unwrapped) NamHybridModel; every parameter and persistent
    buffer must be written exactly once, or nothing trains."""
    mapped = for_this_rank(model, nam_state, lowering, pg_collection)
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]  # Megatron linears' (empty) extra state
    if missing or unexpected:
        raise NamError(f"the nam weights do not fill the Megatron model: missing {missing[:8]}, unexpected "
                       f"{unexpected[:8]}", hint="nam_state_to_megatron and the spec disagree; fix the map")

