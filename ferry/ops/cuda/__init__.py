"""The GPU backend: Triton kernels for GGUF quant types and the torch ops around them."""
