"""NAM56R on Megatron-Core >= 0.19, in parts (section 8 of ARCHITECTURE.md):

* ``lowering``: the model as plain data (pattern, stages, slots, arguments, gaps with what covers each);
  ``lower``, ``megatron_args``, ``check_lowering``. CPU-checkable, imports no megatron.
* ``slots``: the adapters that put nam blocks into Megatron's slots.
* ``spec``: ``transformer_config`` and ``hybrid_stack_spec``, built from the lowering's slots.
* ``weights``: nam's state dict in Megatron's names, for one rank.
* ``model``: ``NamHybridModel`` and ``NamMegatronModel``, what the megatron engine trains.
* ``patches``: the patch-lane entry for HybridModel's stage choice.

Megatron is imported inside functions only, so every part imports on a CPU machine with any megatron-core.
"""

from nam56r.megatron.lowering import (
    MEGATRON_CORE,
    SYMBOL,
    Gap,
    Lowering,
    Slot,
    check_lowering,
    lower,
    megatron_args,
)
from nam56r.megatron.model import NamMegatronModel, nam_hybrid_model_class
from nam56r.megatron.weights import KIND, for_this_rank, load_nam_weights, nam_state_to_megatron

__all__ = [
    "KIND", "MEGATRON_CORE", "SYMBOL", "Gap", "Lowering", "NamMegatronModel", "Slot", "check_lowering",
    "for_this_rank", "load_nam_weights", "lower", "megatron_args", "nam_hybrid_model_class", "nam_state_to_megatron",
]
