"""CPU kernels: ggml's through small graphs, and ferry's own in C, compiled for this machine at first use."""
