"""nam plugin te: Transformer Engine linears (bf16 and FP8) for NAM56R, in the local and the megatron engine.

Importing the package points Transformer Engine's cuDNN loader at torch's bundled cuDNN (``cudnn.py``: the
host's toolkit may carry another version), before anything imports TE."""

from nam_plugin_te.cudnn import prefer_torch_cudnn

prefer_torch_cudnn()
