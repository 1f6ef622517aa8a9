"""ferry: hybrid CPU/GPU inference for Mixture-of-Experts GGUF models."""

import os

__version__ = "0.1.0"

# torch's CUDA allocator in expandable segments, unless the user chose otherwise: the fit fills the GPU to within
# --fit-target of its size, and the fixed-size segments' fragmentation (949 MiB reserved but unused in gpt-oss-20b's
# first prompt at 12 GiB) ran it out of memory (docs/decisions.md). Read at the first CUDA allocation, after this.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
