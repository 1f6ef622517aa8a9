"""Shared by the GPU tests: the mid model's all-CPU logits (the reference every GPU path is held to) and the
KL-divergence / top-1 agreement against them."""

import os

import numpy as np
import pytest
import torch

from ferry.cli import main
from ferry.runtime.engine import Engine
from ferry.runtime.loader import RunConfig, load

if os.environ.get("TRITON_INTERPRET") == "1":  # kernels on the CPU: Triton 3.6's interpreter meets numpy 2
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _numpy2_index(tensor, scope) -> None:
        """A loop bound or index held as a one-element array: numpy 2 refuses int() of it (a TypeError inside
        every `range(0, K, BK)` of a kernel), so take the element."""
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _numpy2_index

    # the interpreter steps through every program in Python: the few-token K-quant kernels' defaults (a row or
    # four a program) made the decode tests' runs minutes long; wider programs compute the same (test_kernels.py
    # tests each configuration on its own)
    from ferry.kernels.cuda import kquant as _kquant

    _kquant.ROWS = _kquant.ROWS_BIG = _kquant.MOE_ROWS = 32
    from ferry.kernels.cuda import krows as _krows

    _krows.gemv_config = lambda cols, rows: (32, 1, 1)
    # the same for the split-layout GEMVs and the experts' (a few rows a program by default): deepseek4-tiny's decode test took
    # 7 minutes, 50 of each step's 73 s in them
    from ferry.kernels.cuda import gemv as _gemv, moe as _moe

    _gemv._gemv_config = lambda outputs, cols: (64, 512, 4)
    _moe._moe_gemv_config = lambda n_ff, pairs: (64, 512, 4)


def place(path, threads: int, **flags):
    """(backend, model) of the file at `path` loaded as a run with these flags would load it (RunConfig's fields)."""
    flags.setdefault("n_gpu_layers", 0)  # no flags: the CPU reference, not the fit's placement
    loaded = load(RunConfig(path, n_threads=threads, quiet=True, **flags))
    return loaded.backend, loaded.model


def kl_top1(want: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-position KL(want || got) in float64, and the share of positions whose top token agrees."""
    lp, lq = torch.log_softmax(want.double(), -1), torch.log_softmax(got.double().cpu(), -1)
    return (lp.exp() * (lp - lq)).sum(-1), (want.argmax(-1) == got.cpu().argmax(-1)).double().mean().item()


@pytest.fixture(scope="module")
def mid(tmp_path_factory):
    """qwen3-moe-mid (Q4_0 experts, Q8_0 rest, 64 experts): its CPU logits over a 300-token prompt."""
    path = tmp_path_factory.mktemp("m") / "mid.gguf"
    assert main(["synth", "qwen3-moe-mid", "-o", str(path), "-q"]) == 0
    cpu, model = place(path, 8)
    tokens = np.random.default_rng(0).integers(0, model.args.n_vocab, 300).tolist()
    want = Engine(model, cpu, n_ctx=512).decode(tokens, all_logits=True)
    return path, tokens, want
