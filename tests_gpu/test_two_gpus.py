"""Layers split across two GPUs (-ts): the logits of one GPU, and where the weights and the KV cache went. Needs a
machine with two GPUs (the device tool's nvidia-h200-x2); elsewhere it is skipped."""

import pytest
import torch

from ferry.backends.multi_gpu import MultiGpuBackend
from ferry.runtime.engine import Engine
from conftest import kl_top1, place

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _run(model, backend, tokens):
    e = Engine(model, backend, n_ctx=512, n_ubatch=128)
    prompt = e.decode(tokens[:250], all_logits=True)
    return torch.cat([prompt] + [e.decode([t]) for t in tokens[250:270]]).cpu(), e


def test_layers_split_across_two_gpus_give_one_gpus_logits(mid):
    path, tokens, want = mid
    one, model = place(path, 8, n_gpu_layers=999, tensor_split="1,0", n_ctx=512)
    assert not isinstance(one, MultiGpuBackend)
    ref, _ = _run(model, one, tokens)
    two, model = place(path, 8, n_gpu_layers=999, tensor_split="1,1", n_ctx=512)
    assert isinstance(two, MultiGpuBackend) and set(two.layers) == {"CUDA0", "CUDA1"}
    got, e = _run(model, two, tokens)
    n = model.args.n_layer
    assert e.kv.k[0].device == torch.device("cuda:0") and e.kv.k[n - 1].device == torch.device("cuda:1")
    first, last = model.blocks[0].attn.wq, model.blocks[-1].attn.wq
    assert two.upload(first).qs.device == torch.device("cuda:0")
    assert two.upload(last).qs.device == torch.device("cuda:1")
    kl, top1 = kl_top1(ref, got)
    print(f"\ntwo GPUs against one: KL median {kl.median():.2e}, max {kl.max():.2e}, top-1 {top1:.4f}")
    assert kl.max() < 1e-4 and top1 >= 0.99  # the same kernels; graphs on one GPU, eager on two
    kl, top1 = kl_top1(want[:270], got)
    print(f"two GPUs against the CPU: KL median {kl.median():.2e}, top-1 {top1:.4f}")
    assert kl.median() < 2e-3 and top1 >= 0.95
