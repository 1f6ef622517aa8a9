"""ferry synth: valid random quant blocks at the asked scale, and routing that stays diverse."""

import numpy as np
import pytest
import torch
from gguf.constants import LlamaFileType

from ferry.gguf.file import GGUFFile
from ferry.gguf.synth import PRESETS, _SCALE_FIELDS, more_bits, random_tensor, synth
from ferry.models import load_model
from ferry.quant import IkQuant, Q, dequantize
from ferry.runtime.engine import Engine


@pytest.mark.parametrize("qtype", list(_SCALE_FIELDS) + [Q.F16, Q.BF16, Q.IQ4_NL, Q.MXFP4] + list(IkQuant),
                         ids=lambda q: q.name)
def test_random_blocks_have_mean_zero_and_the_asked_std(qtype):
    ne = (256, 96)
    values = dequantize(random_tensor(qtype, ne, 0.05, np.random.default_rng(0)), qtype, ne)
    assert np.isfinite(values).all()
    assert abs(values.mean()) < 0.01 and 0.04 < values.std() < 0.06


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "deepseek2-tiny", "glm4moe-tiny", "minimax-m2-tiny",
                                    "qwen35moe-tiny", "qwen3next-tiny", "deepseek4-tiny"])
def test_tiny_preset_routes_a_random_ubatch_to_most_experts_in_every_layer(tmp_path, backend, preset):
    path = tmp_path / "tiny.gguf"
    synth(PRESETS[preset], path, Q.Q4_0, Q.Q8_0, quiet=True)
    model = load_model(GGUFFile(path))
    engine = Engine(model, backend, n_ctx=512, n_ubatch=512)
    tokens = torch.randint(0, model.args.n_vocab, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = engine.decode(tokens)
    assert torch.isfinite(logits).all()
    hit = engine.experts_hit[0]
    n_expert = model.args.n_expert
    assert len(hit) == model.args.n_layer - model.args.n_layer_dense_lead
    assert min(hit) >= 0.9 * n_expert, f"experts hit per layer: {hit} of {n_expert}"


def test_minimax_m2_preset_has_the_real_shapes(tmp_path):
    """MiniMax-M2's config.json: 62 layers of 3072, 48 heads of 128 (8 for keys), rope on 64 of them at 5e6, 256
    experts of 1536 of which 8 are chosen by sigmoid; a cut of it loads with its norms across all heads."""
    p = PRESETS["minimax-m2"]
    assert (p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim, p.n_rot) == (62, 3072, 48, 8, 128, 64)
    assert (p.n_expert, p.n_expert_used, p.n_ff_exp, p.n_vocab, p.gating) == (256, 8, 1536, 200064, 2)
    path = tmp_path / "m.gguf"
    synth(p, path, Q.Q4_0, Q.Q8_0, layers=1, quiet=True, shape_only=True)
    model = load_model(GGUFFile(path))
    attn = model.blocks[0].attn
    assert attn.norm_whole and attn.q_norm.shape == (48 * 128,) and attn.k_norm.shape == (8 * 128,)
    assert model.args.expert_gating == "sigmoid" and model.blocks[0].ffn.norm_topk


def test_deepseek_v4_flash_preset_has_the_real_shapes(tmp_path):
    """DeepSeek-V4-Flash's config: 43 layers of 4096, 64 heads of 512 over one shared key/value head (rope on 64),
    a low-rank query of 1024, 8 output groups of rank 1024, 256 experts of 2048 of which 6 are chosen (the first 3
    layers by hash), a window of 128, two sliding-only layers then compressed sparse (4, the indexer's 64 heads of
    128 picking 512) and heavily compressed (128) in turn. A cut of it loads with those layer kinds."""
    p = PRESETS["deepseek-v4-flash"]
    assert (p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim, p.head_dim_rope) == (43, 4096, 64, 1, 512, 64)
    assert (p.q_lora_rank, p.out_groups, p.out_lora_rank, p.n_expert, p.n_expert_used, p.n_ff_exp) == (
        1024, 8, 1024, 256, 6, 2048)
    assert (p.sliding_window, p.indexer_heads, p.indexer_dim, p.indexer_top_k, p.n_hash_layers) == (128, 64, 128, 512, 3)
    assert p.compress_ratios[:6] == (0, 0, 4, 128, 4, 128) and p.compress_ratios[-1] == 4
    path = tmp_path / "v4.gguf"
    synth(p, path, Q.Q4_0, Q.Q8_0, layers=5, quiet=True, shape_only=True)
    model = load_model(GGUFFile(path))
    assert [b.attn.ratio for b in model.blocks] == [0, 0, 4, 128, 4]
    assert [b.attn.indexer is not None for b in model.blocks] == [False, False, True, False, True]
    assert [b.ffn.hash_ids is not None for b in model.blocks] == [True, True, True, False, False]


def test_qwen35_presets_have_the_real_shapes(tmp_path):
    """Qwen3.5-397B-A17B's config: 60 layers of 4096, three delta-net layers (16 key heads, 64 value heads of 128)
    then one gated attention layer (32 heads of 256, 2 for keys, rope on 64), 512 experts of 1024 of which 10 are
    chosen, a shared one of 1024; Qwen3-Next-80B-A3B's: 48 layers of 2048, 16 / 32 heads of 128, 512 experts of 512.
    A cut of each loads with its layer kinds in order."""
    big, nxt = PRESETS["qwen3.5-397b-a17b"], PRESETS["qwen3-next-80b-a3b"]
    assert (big.n_layer, big.n_embd, big.n_head, big.n_head_kv, big.head_dim, big.n_rot) == (60, 4096, 32, 2, 256, 64)
    assert (big.ssm_k_heads, big.ssm_v_heads, big.ssm_head_dim, big.n_expert, big.n_expert_used) == (16, 64, 128, 512, 10)
    assert (big.n_ff_exp, big.n_ff_shexp, big.n_vocab) == (1024, 1024, 248320)
    assert (nxt.n_layer, nxt.n_embd, nxt.ssm_v_heads, nxt.n_expert, nxt.n_ff_exp, nxt.n_vocab) == (48, 2048, 32, 512, 512,
                                                                                                 151936)
    for name in ("qwen3.5-397b-a17b", "qwen3-next-80b-a3b"):
        path = tmp_path / f"{name}.gguf"
        synth(PRESETS[name], path, Q.Q4_0, Q.Q8_0, layers=4, quiet=True, shape_only=True)
        model = load_model(GGUFFile(path))
        assert model.args.recurrent == (True, True, True, False)
        assert model.blocks[3].attn.gated and model.blocks[0].attn.n_v_heads == PRESETS[name].ssm_v_heads


def test_qwen3_30b_a3b_preset_has_the_real_shapes():
    p = PRESETS["qwen3-30b-a3b"]
    assert (p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim) == (48, 2048, 32, 4, 128)
    assert (p.n_expert, p.n_expert_used, p.n_ff_exp, p.n_vocab) == (128, 8, 768, 151936)


def test_deepseek_presets_have_the_real_shapes():
    lite, v3 = PRESETS["deepseek-v2-lite"], PRESETS["deepseek-v3-6l"]
    assert (lite.n_layer, lite.n_embd, lite.n_head, lite.kv_lora_rank, lite.q_lora_rank) == (27, 2048, 16, 512, 0)
    assert (lite.n_expert, lite.n_expert_used, lite.n_expert_shared, lite.n_ff_exp, lite.n_layer_dense_lead) == \
        (64, 6, 2, 1408, 1)
    assert (lite.head_dim, lite.head_dim_rope, lite.head_dim_v) == (128, 64, 128)
    assert (v3.n_embd, v3.n_head, v3.q_lora_rank, v3.n_expert, v3.n_expert_used, v3.gating) == (7168, 128, 1536, 256, 8, 2)


@pytest.mark.parametrize("legacy", [False, True])
def test_deepseek_files_carry_the_latent_split_as_llama_cpp_writes_it_or_the_legacy_kv_b(tmp_path, backend, legacy):
    path = tmp_path / "ds.gguf"
    synth(PRESETS["deepseek2-tiny"], path, Q.Q4_0, Q.Q8_0, quiet=True, legacy_mla=legacy)
    f = GGUFFile(path)
    assert ("blk.0.attn_kv_b.weight" in f.tensors) == legacy
    assert ("blk.0.attn_k_b.weight" in f.tensors) != legacy
    if not legacy:  # the latent's sizes as the cache's, the expanded per-head ones apart
        assert tuple(f.tensors["blk.0.attn_k_b.weight"].ne) == (32, 64, 4)
        assert (f.get("deepseek2.attention.key_length"), f.get("deepseek2.attention.key_length_mla")) == (80, 48)
    model = load_model(f)
    assert (model.args.n_head_kv, model.args.head_dim_k, model.args.head_dim_v) == (4, 48, 32)
    logits = Engine(model, backend, n_ctx=64).decode(list(range(20)))
    assert torch.isfinite(logits).all()


def test_glm_preset_has_glm_4_5_air_shapes(tmp_path):
    p = PRESETS["glm-4.5-air"]
    assert (p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim, p.n_rot) == (46, 4096, 96, 8, 128, 64)
    assert (p.n_expert, p.n_expert_used, p.n_expert_shared, p.n_ff_exp, p.n_layer_dense_lead, p.gating) == \
        (128, 8, 1, 1408, 1, 2)
    path = tmp_path / "glm.gguf"
    synth(PRESETS["glm4moe-tiny"], path, Q.Q4_0, Q.Q8_0, quiet=True)
    model = load_model(GGUFFile(path))  # rope on half of each head, biases, a shared expert, sigmoid + bias
    assert model.args.n_rot == 32 and model.blocks[0].attn.bq is not None and model.blocks[0].attn.q_norm is None
    assert model.blocks[1].ffn.shared is not None and model.blocks[1].ffn.routing.gating == "sigmoid"


def test_the_q4_k_m_mix_puts_down_in_q6_k_where_llama_quantize_does(tmp_path):
    """Its rule gives 24 of Qwen3-30B-A3B's 48 layers Q6_K down: the first and last 6, and every third between."""
    picked = [i for i in range(48) if more_bits(i, 48)]
    assert picked == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    path = tmp_path / "m.gguf"
    synth(PRESETS["qwen3-moe-tiny"], path, "Q4_K_M", Q.Q8_0, quiet=True)  # 4 layers: the last two more bits
    f = GGUFFile(path)
    assert f.get("general.file_type") == LlamaFileType.MOSTLY_Q4_K_M
    for i in range(4):
        assert f.tensor(f"blk.{i}.ffn_gate_exps.weight").qtype == f.tensor(f"blk.{i}.ffn_up_exps.weight").qtype == Q.Q4_K
        assert f.tensor(f"blk.{i}.ffn_down_exps.weight").qtype == (Q.Q6_K if i >= 2 else Q.Q4_K)
    assert f.tensor("blk.0.attn_q.weight").qtype == Q.Q8_0


@pytest.mark.parametrize("ik", list(IkQuant), ids=lambda q: q.name)
def test_experts_in_ik_llama_cpps_types_are_written_as_ik_llama_cpp_stores_them(tmp_path, ik):
    """`ferry synth --expert-type iq4_ks` (the 30B model in ik's types, for benchmarks against it): the experts under
    ik's type id, read in place where ferry's kernel runs, rewritten as Q8_0 with the same values where it does not."""
    path = tmp_path / "m.gguf"
    synth(PRESETS["qwen3-moe-tiny"], path, ik, Q.Q8_0, quiet=True)
    name = "blk.1.ffn_down_exps.weight"
    kept, rewritten = GGUFFile(path, ik_in_place=frozenset({int(ik)})).tensor(name), GGUFFile(path).tensor(name)
    assert kept.qtype == ik and rewritten.qtype == Q.Q8_0 and rewritten.stored_as == ik.name
    values = dequantize(GGUFFile(path, ik_in_place=frozenset({int(ik)})).data(kept), ik, kept.ne)
    off = np.abs(dequantize(GGUFFile(path).data(rewritten), Q.Q8_0, rewritten.ne) - values).reshape(-1, 32)
    largest = np.abs(values).reshape(-1, 32).max(axis=1, keepdims=True)  # IQ4_K's 32s rounded to 255 levels
    bound = 2.0 ** -11 * np.abs(values).reshape(-1, 32) if ik == IkQuant.IQ4_KS else (1 / 254 + 2.0 ** -11) * largest
    # and fp16's subnormal scales (below 2^-14: steps of 2^-24, half of one times up to 128), float32's rounding
    assert np.all(off <= bound + 2.0 ** -25 * 128 + 2.0 ** -20 * largest)
