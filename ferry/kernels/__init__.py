"""Kernels by device (cuda/: Triton, split by job; cpu/: ggml graphs and ferry's own C kernels), never knowing which
model calls them; capabilities.py: what each quant type can do where."""
