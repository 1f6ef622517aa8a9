"""The gated delta-net's torch forms (layers/delta_net.py) against a float64 recurrence taken one token at a time,
and the recurrent state's life in the engine (kept across u-batches, cleared at position 0, saved and restored)."""

import pytest
import torch

from ferry.layers.delta_net import delta_rule, short_conv


def recurrence64(q, k, v, g, beta, state):
    """The gated delta rule step by step in float64: per head S <- e^g S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(d)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + torch.einsum("hk,hv->hkv", k[t], u)
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]) * q.shape[-1] ** -0.5)
    return torch.stack(outs), s


def inputs(n, heads, d_k, d_v, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(n, heads, d_k, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, heads, d_v, generator=gen)
    g = -torch.rand(n, heads, generator=gen) * 2  # log decays in (-2, 0]
    beta = torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, d_k, d_v, generator=gen) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n, heads, d_k, d_v, chunk", [(1, 3, 8, 8, 64), (7, 2, 16, 8, 4), (64, 4, 16, 16, 64),
                                                       (65, 1, 32, 32, 64), (130, 3, 8, 24, 64), (29, 5, 12, 12, 8)])
def test_the_delta_rule_equals_the_float64_recurrence(n, heads, d_k, d_v, chunk):
    """One token, chunks that divide the tokens and ones that leave a remainder, d_k != d_v: float32 rounding only
    (measured at most 3e-6 against outputs and states of size 0.1-1)."""
    q, k, v, g, beta, state = inputs(n, heads, d_k, d_v, seed=n)
    out, last = delta_rule(q, k, v, g, beta, state, chunk=chunk)
    ref_out, ref_last = recurrence64(q, k, v, g, beta, state)
    assert out.shape == (n, heads, d_v) and last.shape == (heads, d_k, d_v)
    assert (out.double() - ref_out).abs().max() < 2e-5
    assert (last.double() - ref_last).abs().max() < 2e-5


def test_the_delta_rule_in_pieces_equals_it_whole():
    """A sequence cut into u-batches (the state carried between them) gives the outputs of the whole."""
    q, k, v, g, beta, state = inputs(50, 2, 8, 8, seed=3)
    whole, _ = delta_rule(q, k, v, g, beta, state, chunk=16)
    s, outs = state, []
    for a, b in ((0, 1), (1, 20), (20, 21), (21, 50)):
        o, s = delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, chunk=16)
        outs.append(o)
    assert (torch.cat(outs) - whole).abs().max() < 1e-5


@pytest.mark.parametrize("n, kernel", [(1, 4), (5, 4), (3, 2), (17, 5)])
def test_the_short_convolution_reads_the_inputs_before_it(n, kernel):
    """silu(sum_i w[c, i] x[t - kernel + 1 + i, c]) over the kept inputs and the new ones, in float64; the state it
    returns is the last kernel - 1 inputs."""
    gen = torch.Generator().manual_seed(n)
    channels = 6
    x, state = torch.randn(n, channels, generator=gen), torch.randn(kernel - 1, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    out, last = short_conv(x, state, weight)
    xs = torch.cat([state, x]).double()
    ref = torch.stack([(xs[t:t + kernel] * weight.double().t()).sum(0) for t in range(n)])
    assert (out.double() - torch.nn.functional.silu(ref)).abs().max() < 1e-5
    assert torch.equal(last, xs[-(kernel - 1):].float())


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    from ferry.gguf.synth import PRESETS, synth
    from ferry.quant import Q

    path = tmp_path_factory.mktemp("qwen35") / "tiny.gguf"
    # float32 weights: the two forward forms then differ only in float rounding (quantized weights add the
    # activations' quantization, which ggml's graph and ferry's kernels do on different rows)
    synth(PRESETS["qwen35moe-tiny"], path, Q.F32, Q.F32, quiet=True)
    return path


def engine_on(path, backend, graph=True):
    from ferry.gguf.file import GGUFFile
    from ferry.models import load_model
    from ferry.runtime.engine import Engine

    return Engine(load_model(GGUFFile(path)), backend, n_ctx=256, n_ubatch=32, type_k="f32", type_v="f32",
                  graph=graph)


TOKENS = torch.randint(0, 2048, (60,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("graph", [True, False])
def test_a_sequence_starts_from_a_clear_state_after_reset(qwen35, backend, graph):
    """The recurrent state of the last sequence does not leak into the next: a reset engine gives a fresh one's
    logits, bit for bit."""
    engine = engine_on(qwen35, backend, graph)
    first = engine.decode(TOKENS[:40])
    engine.reset()
    assert torch.equal(engine.decode(TOKENS[:40]), first)
    other = engine_on(qwen35, backend, graph).decode(TOKENS[20:40])
    engine.reset()
    assert torch.equal(engine.decode(TOKENS[20:40]), other)


@pytest.mark.parametrize("graph", [True, False])
def test_a_saved_state_takes_the_sequence_back(qwen35, backend, graph):
    """truncate to a position whose state was saved forgets what came after it (llama-sweep-bench's dropped
    tokens); without a saved state a recurrent model refuses to go back part of the way."""
    engine = engine_on(qwen35, backend, graph)
    engine.decode(TOKENS[:30])
    saved = engine.save_state()
    for t in TOKENS[30:35]:
        engine.decode([t])
    with pytest.raises(ValueError, match="recurrent"):
        engine.truncate(30)
    engine.truncate(30, saved)
    again = engine.decode(TOKENS[35:60], all_logits=True)
    straight = engine_on(qwen35, backend, graph)
    straight.decode(TOKENS[:30])
    assert (again - straight.decode(TOKENS[35:60], all_logits=True)).abs().max() < 1e-5


def test_the_graph_and_the_op_by_op_forms_agree(qwen35, backend):
    """ggml's delta-net op and convolution against the torch forms, over u-batches of 32 and single tokens: float32
    rounding (measured: logits of size 1 within 1e-6 of each other)."""
    outs = []
    for graph in (True, False):
        engine = engine_on(qwen35, backend, graph)
        outs.append(torch.cat([engine.decode(TOKENS[:50], all_logits=True)]
                              + [engine.decode([t]) for t in TOKENS[50:]]))
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
