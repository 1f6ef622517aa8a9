"""Triton kernels of the GPU forward, one module per job, and the CUDA runtime and driver calls torch does not
expose."""
