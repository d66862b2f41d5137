"""nam-plugin-mimo-scan: nam's own Mamba-3 MIMO scan kernels (Triton), the ``ssm_mixers`` backend ``mimo-scan``."""
