"""Where weight-bound ops run: the CPU (ggml and ferry's kernels), one GPU, weights in RAM beside a GPU, several
GPUs."""
