"""nam plugin mamba-ssm: NAM56R's Mamba-3 scan on mamba-ssm's Triton (SISO) and TileLang (MIMO) kernels."""
