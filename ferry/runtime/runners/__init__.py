"""How a forward runs: op by op (eager), as one ggml graph (CPU), as CUDA graphs (GPU), over several GPUs."""
