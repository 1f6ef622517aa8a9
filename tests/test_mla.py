"""DeepSeek's latent attention in every -mla mode against transformers: the expanded cache (0), the latent cache with
absorbed attention (1, 2) and the latent cache expanded for large u-batches (3), with f32, f16 and q8_0 caches, over
prompts split into u-batches and then token-by-token generation; and the cache's bytes per token."""

import pytest
import torch

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.models import load_model
from ferry.runtime.runners.ggml_graph import GgmlGraphRunner
from ferry.quant import Q
from ferry.runtime.engine import Engine
from ferry.quant import row_bytes
from tests.fixtures.hf import VOCAB, load_stored_weights, tiny_hf_model, to_gguf

MODES = pytest.mark.parametrize("mla", [0, 1, 2, 3])
EXECUTORS = pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (path, HF model with the file's weights), written once per family and weight type."""
    made = {}

    def get(family: str, qtype: Q = Q.F32):
        if (family, qtype) not in made:
            hf = tiny_hf_model(family)
            path = tmp_path_factory.mktemp("mla") / f"{family}-{qtype.name}.gguf"
            load_stored_weights(hf, to_gguf(hf, family, path, qtype))
            made[family, qtype] = path, hf
        return made[family, qtype]

    return get


def _run(path, mla: int, tokens: list[int], n_prompt: int, n_ubatch: int, cache: str, graph: bool, backend,
         n_ctx: int = 128):
    """Logits of every token: the first n_prompt as a prompt in u-batches, the rest one by one."""
    engine = Engine(load_model(GGUFFile(path), mla=mla), backend, n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=cache,
                    type_v=cache, graph=graph)
    out = [engine.decode(tokens[:n_prompt], all_logits=True)]
    out += [engine.decode([t], all_logits=True) for t in tokens[n_prompt:]]
    return torch.cat(out).double(), engine


def _reference(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor(tokens)[None]).logits[0].double()


def _kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@EXECUTORS
@MODES
@pytest.mark.parametrize("family", ["deepseek2", "deepseek2-lite", "deepseek2-split", "deepseek3"])
@pytest.mark.parametrize("n_ubatch", [8, 33])
def test_every_mode_matches_transformers(family, mla, graph, n_ubatch, files, backend):
    # 33 tokens of prompt (u-batches of 8: below the tiny model's expand_from of 32, so mode 3 runs absorbed; of 33:
    # expanded), then 4 generated one by one (absorbed), all against the cache the prompt filled
    path, hf = files(family)
    tokens = _tokens(37)
    got, _ = _run(path, mla, tokens, 33, n_ubatch, "f32", graph, backend)
    ref = _reference(hf, tokens)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-4, f"{family} -mla {mla}: relative error {rel:.2e}"


@EXECUTORS
@pytest.mark.parametrize("mla", [1, 3])
def test_long_prompts_over_several_cache_lengths(mla, graph, files, backend):
    # 100 tokens in u-batches of 40, 40, 20 (mode 3: expanded over 40 and 80 cached positions, then absorbed), then
    # 20 generated: the latent cache read back at every length up to 120
    path, hf = files("deepseek2")
    tokens = _tokens(120, seed=5)
    got, _ = _run(path, mla, tokens, 100, 40, "f32", graph, backend)
    ref = _reference(hf, tokens)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-4, f"-mla {mla}: relative error {rel:.2e}"


# f32 weights, so that only the cache rounds: measured median KL against transformers, f16 cache 1.0e-6 to 1.3e-6 in
# every mode, q8_0 cache 8e-5 (mode 3) to 1.1e-4 (1, 2); max 5e-3 (one near-tie). The bounds are about 10x that. The
# eager executor reads float caches only (q8_0 there: on the GPU).
@pytest.mark.parametrize("mla,cache,max_median_kl,graph", [
    (m, c, b, g) for m in (1, 2, 3) for c, b, gs in (("f16", 1e-5, (True, False)), ("q8_0", 1e-3, (True,)))
    for g in gs])
def test_f16_and_q8_0_latent_caches_stay_close_to_transformers(mla, cache, max_median_kl, graph, files, backend):
    path, hf = files("deepseek2-wide")  # a latent row of 64 + 32: whole q8_0 blocks, values too
    tokens = _tokens(48, seed=2)
    got, _ = _run(path, mla, tokens, 40, 40, cache, graph, backend)
    kl = _kl(_reference(hf, tokens), got)
    assert kl.median() < max_median_kl, f"-mla {mla} {cache}: median KL {kl.median():.2e}"
    assert kl.max() < 0.05, f"-mla {mla} {cache}: max KL {kl.max():.2e}"


# Q8_0 weights on both sides and an f16 cache: ggml also rounds activations to q8; measured median KL 2.5e-4 to
# 5.2e-4 in every mode and executor, max 1.5e-2
@EXECUTORS
@MODES
def test_q8_0_weights_with_an_f16_cache_in_every_mode(mla, graph, files, backend):
    path, hf = files("deepseek2-wide", Q.Q8_0)
    tokens = _tokens(48, seed=2)
    got, _ = _run(path, mla, tokens, 40, 40, "f16", graph, backend)
    kl = _kl(_reference(hf, tokens), got)
    assert kl.median() < 2e-3, f"-mla {mla}: median KL {kl.median():.2e}"
    assert kl.max() < 0.05, f"-mla {mla}: max KL {kl.max():.2e}"


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_the_latent_cache_holds_the_latent_and_the_rope_key_only(cache, files, backend):
    path, _ = files("deepseek2-wide")
    model = load_model(GGUFFile(path), mla=2)
    a = model.args
    lat = model.latent_layers()[0]
    per_token = a.n_layer * row_bytes(Q[cache.upper()], lat.kv_lora_rank + lat.head_dim_rope)
    assert model.cache_layout().bytes_per_token(a.n_layer, cache, cache) == per_token
    engine = Engine(model, backend, n_ctx=64, type_k=cache, type_v=cache)
    assert engine.kv.n_bytes == 64 * per_token
    # the expanded cache of the same model: every head's key and value
    expanded = load_model(GGUFFile(path), mla=0).cache_layout()
    assert expanded.bytes_per_token(a.n_layer) == a.n_layer * 2 * a.n_head * (a.head_dim_k + a.head_dim_v)
    assert expanded.bytes_per_token(a.n_layer) > model.cache_layout().bytes_per_token(a.n_layer)


def test_mode_3_expands_from_the_crossover_and_absorbs_below(files, backend):
    path, _ = files("deepseek2")
    model = load_model(GGUFFile(path))  # no flag: ferry's choice
    lat = model.latent_layers()[0]
    assert lat.mla == 3
    # lora 32, nope 16, v 16: absorbing costs n * 32 * 32 more in projections, expanding n_kv * 32 * 32 more; it
    # saves n * n_kv * (64 - 32) in attention
    assert lat.expand_from == 32
    engine = Engine(model, backend, n_ctx=128, n_ubatch=40)
    engine.decode(_tokens(60))  # 40 tokens (expanded: a graph for that cache length), then 20 (absorbed)
    assert isinstance(engine.runner, GgmlGraphRunner)
    per_length = [k for k in engine.runner.graphs if len(k) == 4]
    assert [k[0] for k in per_length] == [40]
    assert any(k[0] == 20 and len(k) == 3 for k in engine.runner.graphs)


def test_an_unknown_mode_is_refused_and_other_models_ignore_the_flag(files, tiny):
    path, _ = files("deepseek2")
    with pytest.raises(FerryError, match="-mla 4: valid modes"):
        load_model(GGUFFile(path), mla=4)
    model = load_model(GGUFFile(tiny), mla=2)  # no latent attention: the flag means nothing there
    assert not model.latent_layers() and not model.cache_layout().v_in_k


@EXECUTORS
def test_attention_max_batch_splits_heads_and_changes_nothing(graph, files, backend):
    # -amb bounds mode 3's expanded keys and values at 6 bytes per value: 6 * n_kv * (16 + 8 + 16) bytes per head of
    # the tiny model, so 1 MiB holds all 4 heads at 60 positions and 2 at 2000; the run below expands one head at a
    # time (the tiny model cannot reach that through whole MiB) and must give the same logits
    path, hf = files("deepseek2")
    tokens = _tokens(60, seed=4)
    model = load_model(GGUFFile(path), mla=3, max_batch_mib=1)
    lat = model.latent_layers()[0]
    assert lat.heads_at_once(60) == lat.n_head  # 1 MiB holds every head here
    assert lat.heads_at_once(2000) == 2**20 // (6 * 2000 * 40)  # 2 heads of 4 at 2000 positions
    for attn in model.latent_layers():  # one head at a time
        attn.max_batch_mib = 1
        attn.heads_at_once = lambda n_kv: 1
    engine = Engine(model, backend, n_ctx=64, n_ubatch=40, type_k="f32", type_v="f32", graph=graph)
    got = torch.cat([engine.decode(tokens[:40], all_logits=True), engine.decode(tokens[40:], all_logits=True)])
    ref = _reference(hf, tokens)
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative error {rel:.2e}"
    # ggml expands through each head's rows of kv_b; torch through each head's slice of k_b / v_b (no kv_b at all)
    assert all(len(attn._kv_b_rows) == (attn.n_head if graph else 0) for attn in model.latent_layers())
    with pytest.raises(FerryError, match="-amb -1"):
        load_model(GGUFFile(path), max_batch_mib=-1)


def test_the_latent_cache_needs_one_type_for_keys_and_values(files, backend):
    # the values are the keys' first values: as llama.cpp, refuse a -ctv that cannot apply
    path, _ = files("deepseek2-wide")
    with pytest.raises(FerryError, match="-ctv q8_0 differs from -ctk f16"):
        Engine(load_model(GGUFFile(path), mla=3), backend, n_ctx=64, type_k="f16", type_v="q8_0")
    Engine(load_model(GGUFFile(path), mla=0), backend, n_ctx=64, type_k="f16", type_v="bf16")  # expanded: fine


@pytest.mark.parametrize("mla", [1, 3])
def test_server_slots_share_the_latent_cache_and_decode_as_alone(mla, files, backend):
    # two sequences in one latent cache, fed together in batches (40 tokens: mode 3 expands every cached cell, the
    # other slot's included, under the mask), give each one's logits from decoding it alone
    path, _ = files("deepseek2")
    model = load_model(GGUFFile(path), mla=mla)
    a, b = _tokens(30, seed=8), _tokens(20, seed=9)
    alone = [Engine(model, backend, n_ctx=64, type_k="f32", type_v="f32").decode(s, all_logits=True) for s in (a, b)]
    e = Engine(model, backend, n_ctx=128, n_ubatch=64, type_k="f32", type_v="f32")
    first = e.decode_sequences(a[:20] + b[:20], [0] * 20 + [1] * 20, list(range(20)) * 2, seq_len=64)
    rest = e.decode_sequences(a[20:], [0] * 10, list(range(20, 30)), seq_len=64)
    assert torch.allclose(torch.cat([first[:20], rest]), alone[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(first[20:], alone[1], atol=1e-4, rtol=1e-4)
