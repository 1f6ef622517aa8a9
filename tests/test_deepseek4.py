"""DeepSeek-V4 (deepseek4) from llama.cpp's own converter: a tiny random transformers model, written in DeepSeek's
original layout (tests/fixtures/dsv4.py), converted, and ferry's logits on that file against transformers'."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ferry.gguf.file import GGUFFile
from ferry.gguf.writer import TensorSpec, write_gguf
from ferry.models import load_model
from ferry.models.base import ModelArgs
from ferry.quant import Q, dequantize
from ferry.runtime.engine import Engine
from tests.fixtures.dsv4 import CSA, HCA, save_original_layout, tiny_dsv4
from tests.fixtures.hf import VOCAB

ROOT = Path(__file__).resolve().parents[1]
N = 64  # tokens: 16 CSA entries (top-k 4), 4 HCA entries, 8 windows of 8


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory, llamacpp_tree):
    """(the converter's file (MXFP4 experts), the same with its experts in f32, the transformers model, its logits
    of the N-token prompt)."""
    root = tmp_path_factory.mktemp("dsv4")
    model = tiny_dsv4()
    save_original_layout(model, root / "hf")
    path = root / "dsv4.gguf"
    run = subprocess.run([sys.executable, str(ROOT / "tests/fixtures/llamacpp_convert.py"), str(llamacpp_tree),
                          str(root / "hf"), str(path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    f = GGUFFile(path)
    specs = []
    for t in f.tensors.values():
        raw = f.data(t)
        if t.qtype == Q.MXFP4:  # the values the MXFP4 blocks hold, in f32: the experts' products exact
            raw = np.ascontiguousarray(dequantize(raw, t.qtype, t.ne), dtype=np.float32).view(np.uint8).reshape(-1)
        specs.append(TensorSpec(t.name, Q.F32 if t.qtype == Q.MXFP4 else t.qtype, t.ne, lambda raw=raw: raw))
    f32 = root / "dsv4-f32.gguf"
    meta = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in f.metadata.items()
            if not k.startswith("general.")}
    write_gguf(f32, "deepseek4", meta, specs)
    tokens = torch.randint(0, VOCAB, (N,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor(tokens)[None]).logits[0].double()
    return path, f32, tokens, ref


def _kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    lp, lq = ref.log_softmax(-1), got.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def test_the_converters_metadata_reads_as_deepseek_v4(dsv4):
    args = ModelArgs.from_gguf(GGUFFile(dsv4[0]))
    assert args.v4.compress_ratios == (0, CSA, HCA, CSA) and args.indexer_layers == (1, 3)
    assert args.expert_gating == "sqrtsoftplus" and args.v4.n_hash_layers == 1 and args.v4.n_hc == 4
    assert args.yarn is not None and args.v4.compress_rope_base != args.rope_base


@pytest.mark.slow
@pytest.mark.parametrize("ubatch", [7, 64])
def test_deepseek4_gives_transformers_logits(dsv4, backend, ubatch):
    """The first 40 tokens in u-batches of `ubatch` (7: windows and u-batches out of step), then the rest one by one,
    f32 cache and the experts' values in f32: only float32 rounding may differ (measured: KL 1e-11)."""
    _, f32, tokens, ref = dsv4
    engine = Engine(load_model(GGUFFile(f32)), backend, n_ctx=N, n_ubatch=ubatch, type_k="f32", type_v="f32")
    got = torch.cat([engine.decode(tokens[:40], all_logits=True)]
                    + [engine.decode([t], all_logits=True) for t in tokens[40:]])
    assert _kl(ref, got).max() < 1e-6
    assert (ref.argmax(-1) == got.argmax(-1)).all()


@pytest.mark.slow
def test_deepseek4_mxfp4_experts_and_f16_cache_stay_close(dsv4, backend):
    """The converter's own file (MXFP4 experts, which ggml multiplies by activations rounded to q8, as llama.cpp
    does) with the default f16 cache: the logits move a little. Bounds as gpt-oss's MXFP4 test: the median KL, and
    top-1 where the reference's margin is clear. (Measured on the dev VM: KL median 3e-4, max 0.14 at the one
    token whose layer-2 router, a near tie, picks another expert under the rounding.)"""
    path, _, tokens, ref = dsv4
    engine = Engine(load_model(GGUFFile(path)), backend, n_ctx=N, n_ubatch=16)
    got = engine.decode(tokens, all_logits=True)
    kl = _kl(ref, got)
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert kl.max() < 0.25 and kl.median() < 1e-3, f"KL max {kl.max():.2e}, median {kl.median():.2e}"
    assert (ref.argmax(-1) == got.argmax(-1))[clear].all()


@pytest.mark.slow
def test_a_deepseek4_sequence_goes_back_only_to_a_saved_state(dsv4, backend):
    """The compressors' raw rows hold every position at once, as a recurrent state does: truncating to a position
    needs the state saved there, and with it the continuation's logits are those of an uninterrupted run."""
    _, f32, tokens, _ = dsv4
    engine = Engine(load_model(GGUFFile(f32)), backend, n_ctx=N, type_k="f32", type_v="f32")
    engine.decode(tokens[:21])
    saved = engine.save_state()
    first = engine.decode(tokens[21:30], all_logits=True)
    with pytest.raises(ValueError):
        engine.truncate(10)
    engine.truncate(21, saved)
    again = engine.decode(tokens[21:30], all_logits=True)
    assert torch.equal(first, again)


@pytest.mark.slow
def test_two_deepseek4_sequences_in_one_cache_give_each_ones_logits(dsv4, backend):
    """A server's slots: two sequences in one cache (each its own cells, compressor entries and raw rows), fed in
    interleaved runs, each gives the logits it gives alone."""
    _, f32, tokens, _ = dsv4
    model = load_model(GGUFFile(f32))
    other = tokens[::-1]
    alone = [Engine(model, backend, n_ctx=N, type_k="f32", type_v="f32").decode(t[:37], all_logits=True)
             for t in (tokens, other)]
    engine = Engine(model, backend, n_ctx=2 * N, type_k="f32", type_v="f32", n_seq=2)
    got = [[], []]
    for a, b in ((0, 13), (13, 20), (20, 37)):  # runs of each sequence in one call
        n = b - a
        logits = engine.decode_sequences(tokens[a:b] + other[a:b], [0] * n + [1] * n, [*range(a, b)] * 2, N)
        got[0].append(logits[:n])
        got[1].append(logits[n:])
    for want, parts in zip(alone, got):
        assert torch.allclose(torch.cat(parts), want, atol=1e-4)


def test_a_quantized_cache_is_refused_before_the_first_step(tmp_path):
    """-ctk q8_0: the compressed attention reads float rows (torch's and the GPU kernels'), so the run stops in one
    line when the cache is made, before any output."""
    import subprocess
    import sys

    from ferry.cli import main

    path = tmp_path / "dsv4.gguf"
    assert main(["synth", "deepseek4-tiny", "-o", str(path), "-q"]) == 0
    r = subprocess.run([sys.executable, "-m", "ferry", "run", "-m", str(path), "-ctk", "q8_0", "-ctv", "q8_0", "-ngl",
                        "0", "-n", "2", "hello"], capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "reads float cache rows" in lines[0], r.stderr
    assert r.stdout == ""
