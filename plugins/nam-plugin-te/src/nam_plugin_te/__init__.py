"""nam plugin te: Transformer Engine linears (bf16 and FP8) for NAM56R, in the local and the megatron engine.

Importing ``nam_core`` (which this package does first) points Transformer Engine's cuDNN loader at torch's
bundled cuDNN when TE is installed (``nam_core/cudnn.py``: the host's toolkit may carry another version),
before anything imports TE."""

import nam_core  # noqa: F401
