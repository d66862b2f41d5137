"""The lowering as Megatron-Core objects: ``transformer_config`` from its arguments, ``hybrid_stack_spec``
from its slots. Every class in the spec is the one a slot names (``Slot.adapter`` for a nam block, else
``Slot.module``); this module only knows where Megatron's layers keep their submodules, and the pieces nam
does not lower (bias-dropout-add, the MTP layer's projection). Megatron is imported inside functions only."""

from __future__ import annotations

from typing import Any

import torch

from nam56r.megatron.lowering import Lowering, Slot
from nam56r.megatron.slots import Slots
from nam_core.errors import ConfigError

TRANSFORMER_LAYER = "megatron.core.transformer.transformer_layer.TransformerLayerSubmodules"
LAYERS = {  # HybridStackSubmodules field -> (its submodules class, fields nam does not lower: "norm"/"bda"/...)
    "mamba_layer": ("megatron.core.ssm.mamba_layer.MambaLayerSubmodules", {"mamba_bda": "bda"}),
    "moe_layer": (TRANSFORMER_LAYER, {"pre_mlp_layernorm": "norm", "mlp_bda": "bda"}),
    "dsa_layer": (TRANSFORMER_LAYER, {"input_layernorm": "norm", "self_attn_bda": "bda"}),
    "mla_layer": (TRANSFORMER_LAYER, {"input_layernorm": "norm", "self_attn_bda": "bda"}),
    "mlp_layer": (TRANSFORMER_LAYER, {"pre_mlp_layernorm": "norm", "mlp_bda": "bda", "mlp": "dense_mlp"}),
    "mtp_block_spec": ("megatron.core.transformer.multi_token_prediction.MultiTokenPredictionBlockSubmodules",
                       {"layer_specs": "mtp_layers"}),
}
"""Where Megatron's layers keep their submodules (0.19 ``hybrid_stack_spec``, §1.4)."""
MODEL_SLOTS = ("embedding", "final_norm", "output_layer")
"""Slots around the stack: ``NamHybridModel`` builds them (``nam56r.megatron.model``)."""
MOE_SLOT = "moe_layer.submodules.mlp"
EXPERTS_SLOT = "moe_layer.submodules.mlp.submodules.experts"
"""Megatron's MoELayer and, inside it, nam's experts module (built by ``_moe``)."""
NORM_SLOT = "mamba_layer.submodules.norm"
"""The norm the stack's layers use (the lowering's RMSNorm, Megatron's WrappedTorchNorm)."""


def transformer_config(lowering) -> Any:
    """``MLATransformerConfig`` from the lowering's ``config_args``, with what a run without Transformer
    Engine and with nam's initialisation needs on top (each override says why)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    args = dict(lowering.config_args)
    args["activation_func"] = {"silu": F.silu}[args["activation_func"]]
    args["params_dtype"] = getattr(torch, args["params_dtype"])
    args.update(
        pipeline_dtype=args["params_dtype"],  # the dtype of activations sent between stages
        hidden_dropout=0.0, attention_dropout=0.0,  # nam56r has no dropout (Megatron defaults to 0.1)
        perform_initialization=False,  # weights come from nam's initialisation (nam_state_to_megatron)
    )
    if lowering.chunks > 1:
        # Each chunk is built with its vp_stage (its chunk index); LanguageModule's embedding setup asserts
        # that an MTP stage without embeddings is not the first virtual stage of pipeline rank 0, which only
        # holds when it knows the virtual size. Megatron's interleaved schedule never runs here (a registered
        # schedule drives the chunks), and parallel_state gets no virtual size.
        args["virtual_pipeline_model_parallel_size"] = lowering.chunks
    return MLATransformerConfig(**args)


def slot_class(slot: Slot) -> Any:
    """The class the spec puts in ``slot``."""
    from megatron.core.transformer.spec_utils import import_module

    return import_module(tuple((slot.adapter or slot.module).rsplit(".", 1)))


def hybrid_stack_spec(lowering: Lowering, slots: Slots):
    """The ``HybridStack`` spec, one ``HybridStackSubmodules`` field per layer slot of the lowering, each
    layer's submodules from its child slots (``<layer>.submodules.<field>``); nam blocks through their
    adapters, built with the chunk's shared ``slots``."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    by_path = {s.path: s for s in lowering.slots}
    layers = [p for p in by_path if "." not in p and p not in MODEL_SLOTS]
    children = [p for p in by_path if p.count(".") == 2]  # <layer>.submodules.<field>; deeper ones: their parent's
    unknown = [p for p in layers if p not in LAYERS] + [p for p in children if p.split(".")[0] not in LAYERS]
    if unknown or NORM_SLOT not in by_path:
        raise ConfigError(f"the lowering's slots {unknown or [NORM_SLOT + ' (missing)']} have no place in "
                          "Megatron's HybridStack as this spec knows it",
                          hint="nam56r/megatron/lowering.py and nam56r/megatron/spec.py must change together")
    fixed = _fixed(slot_class(by_path[NORM_SLOT]), lowering)

    def child(path: str):
        slot = by_path[path]
        if path == MOE_SLOT:
            return _moe(slot, by_path[EXPERTS_SLOT], slots, lowering)
        params = {"nam": slots, **slot.adapter_params} if slot.provider == "nam" else {}
        return ModuleSpec(module=slot_class(slot), params=params)

    fields = {}
    for layer in layers:
        submodules, lowered = LAYERS[layer]
        own = {p.rsplit(".", 1)[1]: child(p) for p in children if p.startswith(f"{layer}.submodules.")}
        sub = import_module(tuple(submodules.rsplit(".", 1)))(**{k: fixed[v] for k, v in lowered.items()}, **own)
        fields[layer] = ModuleSpec(module=slot_class(by_path[layer]), submodules=sub)
    return ModuleSpec(module=HybridStack, params={"post_layer_norm": False},  # NamHybridModel applies final_norm
                      submodules=HybridStackSubmodules(**fields))


def _fixed(norm, lowering: Lowering) -> dict:
    """The submodules nam does not lower: bias-dropout-add, the MTP depths' dense MLP and MTP layer."""
    from functools import partial

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    ColumnParallelLinear, RowParallelLinear = _linears(lowering)
    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
        layer_norm=IdentityOp))  # nam's MTP norms live in NamHybridModel.mtp_norms (nam56r.megatron.model)
    return {"norm": norm, "bda": get_bias_dropout_add, "mtp_layers": [mtp_layer],
            "dense_mlp": partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))}


def _linears(lowering: Lowering) -> tuple[type, type]:
    """Megatron's column- and row-parallel linear classes for the lowering's ``linears``: its own, or its
    Transformer Engine modules (``TEColumnParallelLinear``, ``TERowParallelLinear``: TE GEMMs, FP8 under the
    config's ``fp8``)."""
    if lowering.linears == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        return TEColumnParallelLinear, TERowParallelLinear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _moe(slot: Slot, experts: Slot, slots: Slots, lowering: Lowering):
    """Megatron's MoE spec (router, shared expert: its local linears, or its TE ones with the lowering's
    ``linears``) with the slot's MoE layer class and nam's experts module in place of ``SequentialMLP``
    (``nam56r.megatron.moe``), or Megatron's own ``TEGroupedMLP`` where the experts slot names it. Megatron's spec
    is a ``functools.partial`` of the layer class; the layer calls its ``experts`` entry as
    ``(num_local_experts, config, ...)``."""
    import dataclasses
    from functools import partial

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    moe = get_moe_module_spec(use_te=lowering.linears == "transformer_engine",
                              num_experts=lowering.config_args["num_moe_experts"],
                              moe_grouped_gemm=lowering.config_args["moe_grouped_gemm"])
    layer = slot_class(slot)
    if not isinstance(moe, partial) or not issubclass(layer, moe.func):
        raise ConfigError(f"Megatron's local MoE spec is {moe!r}; the lowering's {slot.adapter} must subclass the "
                          "layer class it builds", hint="check megatron-core's get_moe_module_spec")
    submodules = moe.keywords["submodules"]
    if experts.provider == "nam":
        submodules = dataclasses.replace(submodules, experts=partial(slot_class(experts), nam=slots))
    elif submodules.experts.func is not slot_class(experts):
        raise ConfigError(f"the experts slot names {experts.module}; Megatron's MoE spec builds {submodules.experts!r}",
                          hint="check megatron-core's get_moe_module_spec (moe_grouped_gemm with Transformer Engine)")
    return partial(layer, submodules=submodules)
