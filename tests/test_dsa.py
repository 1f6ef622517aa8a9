"""DeepSeek sparse attention (deepseek32, glm-dsa): the lightning indexer's scores and top-k against a float64
reference; ggml's graph against torch's op-by-op path past the top-k; dense attention below it; the indexer's keys
in the cache, the memory plan and the server's RAM prompt cache. (The converter's files against transformers:
test_converter.py.)"""

import pytest
import torch

from ferry.cli import main
from ferry.gguf.file import GGUFFile
from ferry.layers.cache import describe_cache
from ferry.layers.indexer import scores, top_k_mask
from ferry.models import load_model
from ferry.runtime.engine import Engine
from ferry.runtime.kv_cache import KVCache

SHAPES = [(1, 1, 1, 1), (1, 8, 32, 100), (7, 3, 5, 13), (16, 64, 128, 300), (33, 5, 17, 70)]


@pytest.mark.parametrize("n,heads,d,n_kv", SHAPES)
def test_the_indexers_scores_and_top_k_match_a_float64_reference(n, heads, d, n_kv):
    g = torch.Generator().manual_seed(n * 1000 + n_kv)
    q, keys, w = torch.randn(n, heads, d, generator=g), torch.randn(n_kv, d, generator=g), torch.randn(n, heads, generator=g)
    ref = torch.zeros(n, n_kv, dtype=torch.float64)
    for s in range(n):
        for h in range(heads):
            ref[s] += w[s, h].double() * (keys.double() @ q[s, h].double()).clamp(min=0)
    got = scores(q, keys, w)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * d ** 0.5)
    allowed = torch.rand(n, n_kv, generator=g) < 0.7
    top_k = max(1, n_kv // 3)
    chosen = top_k_mask(ref.float(), allowed, top_k)
    assert not (chosen & ~allowed).any()
    for s in range(n):  # as many as it may take (all it sees where fewer), none scoring below one left out (ties:
        # a relu of zero in every head is common)
        picked, left = ref[s][chosen[s]], ref[s][allowed[s] & ~chosen[s]]
        assert len(picked) == min(top_k, int(allowed[s].sum()))
        assert not len(left) or picked.min() >= left.max()


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """name -> a synthetic deepseek32-tiny / glm-dsa-tiny file in f32 (indexer top-k 16; glm-dsa-tiny's layers 1 and 3
    share the selection of the layer before): ggml's and torch's products then agree to float32 rounding, and so do
    their selections."""
    folder = tmp_path_factory.mktemp("dsa")
    made = {}
    for name in ("deepseek32-tiny", "glm-dsa-tiny"):
        made[name] = folder / f"{name}.gguf"
        assert main(["synth", name, "-o", str(made[name]), "--expert-type", "f32", "--type", "f32", "-q"]) == 0
    return made


def _logits(path, backend, tokens, n_prompt, graph, top_k=None, mla=3, n_ubatch=32, cache="f32"):
    model = load_model(GGUFFile(path), mla=mla)
    if top_k is not None:
        for block in model.blocks:
            if block.attn.indexer is not None:
                block.attn.indexer.top_k = top_k
    engine = Engine(model, backend, n_ctx=256, n_ubatch=n_ubatch, type_k=cache, type_v=cache, graph=graph)
    return torch.cat([engine.decode(tokens[:n_prompt], all_logits=True)]
                     + [engine.decode([t], all_logits=True) for t in tokens[n_prompt:]]).double()


def _kl(p, q):
    lp, lq = p.log_softmax(-1), q.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("name", ["deepseek32-tiny", "glm-dsa-tiny"])
@pytest.mark.parametrize("mla", [0, 1, 3])
def test_ggmls_graph_selects_as_torch_does_past_the_top_k(name, mla, sparse, backend):
    """A 70-token prompt in u-batches of 16 (the first dense, whose indexer keys the later ones read), then 10
    generated tokens: the graph (scores on a cache length rounded up to a power of two, the positions past it masked)
    and torch's path agree to float32 rounding (measured: KL 2e-14)."""
    tokens = torch.randint(0, 2000, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    graph = _logits(sparse[name], backend, tokens, 70, True, mla=mla, n_ubatch=16)
    eager = _logits(sparse[name], backend, tokens, 70, False, mla=mla, n_ubatch=16)
    kl = _kl(eager, graph)
    assert kl.max() < 1e-10, f"KL max {kl.max():.2e}"
    assert (eager.argmax(-1) == graph.argmax(-1)).all()


def test_the_graph_scores_a_prompt_in_pieces_of_tokens_as_it_does_whole(sparse, backend, monkeypatch):
    """ggml's graph holds a prompt's per-head scores in pieces of tokens (SCORE_FLOATS): at a budget of 3 tokens a
    piece (8 heads of 128 cells) it selects as torch's path does."""
    from ferry.runtime.runners import ggml_graph

    monkeypatch.setattr(ggml_graph, "SCORE_FLOATS", 3 * 8 * 128)
    tokens = torch.randint(0, 2000, (80,), generator=torch.Generator().manual_seed(6)).tolist()
    path = sparse["glm-dsa-tiny"]
    graph = _logits(path, backend, tokens, 70, True, n_ubatch=32)
    eager = _logits(path, backend, tokens, 70, False, n_ubatch=32)
    assert _kl(eager, graph).max() < 1e-10 and (eager.argmax(-1) == graph.argmax(-1)).all()


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_below_the_top_k_sparse_attention_is_dense(graph, sparse, backend):
    """Up to 16 positions (the top-k) every query attends to all it sees: the logits are exactly those of the same
    model with no top-k; past it they are not (the selection drops positions)."""
    tokens = torch.randint(0, 2000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    path = sparse["deepseek32-tiny"]
    sparse_run = _logits(path, backend, tokens, 8, graph, n_ubatch=8)
    dense_run = _logits(path, backend, tokens, 8, graph, top_k=10 ** 6, n_ubatch=8)
    assert torch.equal(sparse_run[:16], dense_run[:16])
    assert _kl(dense_run[16:], sparse_run[16:]).max() > 1e-4


def test_the_cache_keeps_the_indexers_keys_where_a_layer_has_an_indexer(sparse):
    """glm-dsa-tiny: indexer keys (32 values per position, f16 beside an f16 cache) in layers 0 and 2 only, counted
    in the bytes per token and the cache's size, described, and copied with the rest for the RAM prompt cache."""
    model = load_model(GGUFFile(sparse["glm-dsa-tiny"]))
    layout = model.cache_layout()
    assert layout.index_layers == (0, 2) and layout.index_dim == 32
    latent = 4 * 2 * (64 + 16)  # four layers' latent and rope key rows, f16
    assert layout.bytes_per_token(4) == latent + 2 * 2 * 32
    assert layout.bytes_per_token(4, "f32", "f32") == 2 * latent + 2 * 4 * 32  # an f32 cache keeps f32 keys there too
    assert layout.bytes_per_token(4, "q8_0", "q8_0") == 4 * 34 * 80 // 32 + 2 * 2 * 32  # a quantized one f16
    per_token, line = describe_cache(model.args, 3)
    assert per_token == latent + 128 and "indexer keys" in line and "16 best positions" in line
    kv = KVCache.of(layout, 4, 64, n_seq=2)  # two sequences of 32 positions
    assert [a.shape for a in kv.index] == [(64, 64), (0, 64), (64, 64), (0, 64)]
    assert kv.n_bytes == 64 * (latent + 128)
    kv.index[2][5:8] = 7
    rows = kv.copy_rows(0, 8)  # sequence 0's first 8 positions (the server's RAM prompt cache)
    kv.index[2][:] = 0
    kv.put_rows(1, rows, 8)  # into sequence 1's
    assert (kv.index[2][37:40] == 7).all() and kv.index[2].sum() == 3 * 64 * 7


class _File:
    """The parts of a GGUFFile that ModelArgs.read_indexer reads."""

    def __init__(self, tensors, **metadata):
        self.path, self.tensors, self.metadata = "m.gguf", set(tensors), metadata

    def get(self, key, default=None):
        return self.metadata.get(key, default)


def test_indexer_layers_come_from_the_tensors_and_must_match_the_types_the_file_states():
    """GLM-5.2's layers without indexer tensors share the selection; attention.indexer.types saying otherwise, or a
    first layer without an indexer, is a corrupt file: FerryError (one line, exit 2 at the command line)."""
    from ferry.errors import FerryError
    from ferry.models.base import ModelArgs

    args = ModelArgs("glm-dsa", 100, 64, 64, 4, 4, 4, 24, 16, 128, 1e-6, 1e4, 1.0, 8)
    sizes = {"attention.indexer.head_count": 8, "attention.indexer.key_length": 16, "attention.indexer.top_k": 8}
    key = lambda name: sizes[name]  # noqa: E731
    with_indexer = [f"blk.{i}.indexer.attn_k.weight" for i in (0, 2)]
    args.read_indexer(_File(with_indexer, **{"glm-dsa.attention.indexer.types": [True, False, True, False]}), key)
    assert args.indexer_layers == (0, 2) and args.indexer_top_k == 8
    with pytest.raises(FerryError, match="indexer.types does not match"):
        args.read_indexer(_File(with_indexer, **{"glm-dsa.attention.indexer.types": [True] * 4}), key)
    with pytest.raises(FerryError, match="layer 0 has no indexer"):
        args.read_indexer(_File(["blk.1.indexer.attn_k.weight"]), key)
