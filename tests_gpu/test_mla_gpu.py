"""DeepSeek's latent attention on the GPU against the all-CPU result, on DeepSeek-V2-Lite's shapes (4 layers: one
dense, three with 64 routed experts and 2 shared; kv_lora_rank 512, rope 64): every -mla mode, f16 and q8_0 caches,
prompts above and below mode 3's expansion crossover, token-by-token generation through CUDA graphs, and the hybrid
runtime with the experts in RAM."""

import numpy as np
import pytest
import torch

from ferry.cli import main
from ferry.gguf.file import GGUFFile
from ferry.models import load_model
from ferry.backends.cuda import CudaBackend
from ferry.runtime.runners.cuda_graphs import CudaGraphRunner
from ferry.runtime.engine import Engine
from conftest import kl_top1, place

N_PROMPT, N_GEN = 300, 30


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    """deepseek-v2-lite cut to 4 layers: its CPU logits (mode 3, f16 cache) over a prompt, then token by token."""
    path = tmp_path_factory.mktemp("ds") / "lite4.gguf"
    assert main(["synth", "deepseek-v2-lite", "--layers", "4", "-o", str(path), "-q"]) == 0
    cpu, model = place(path, 8)
    tokens = np.random.default_rng(0).integers(0, model.args.n_vocab, N_PROMPT + N_GEN).tolist()
    e = Engine(model, cpu, n_ctx=512)
    want = torch.cat([e.decode(tokens[:N_PROMPT], all_logits=True)] + [e.decode([t]) for t in tokens[N_PROMPT:]])
    return path, tokens, want


def _check(want, got, label: str) -> None:
    kl, top1 = kl_top1(want, got)
    print(f"\n{label}: KL median {kl.median():.2e}, max {kl.max():.2e}, top-1 {top1:.4f}")
    # rounding only: bf16/f16 activations on the GPU against ggml's 8-bit ones (as tests_gpu/test_model_gpu.py)
    assert kl.median() < 2e-3 and kl.max() < 3e-2 and top1 >= 0.95


def _run(engine, tokens):
    return torch.cat([engine.decode(tokens[:N_PROMPT], all_logits=True)] +
                     [engine.decode([t]) for t in tokens[N_PROMPT:]])


def _fixed(form: str):
    return lambda n_tokens, n_kv: form


@pytest.mark.parametrize("mla,form", [(0, None), (1, None), (3, None), (3, "absorbed"), (3, "expanded")])  # mode
# 3 as timed (both forms run while it measures), and with each prompt form set
@pytest.mark.parametrize("ubatch", [512, 64])
@pytest.mark.parametrize("ctk", ["f16", "q8_0"])
def test_all_gpu_matches_the_cpu(lite, mla, form, ubatch, ctk):
    path, tokens, want = lite
    model = load_model(GGUFFile(path), mla=mla)
    engine = Engine(model, CudaBackend(), n_ctx=512, n_ubatch=ubatch, type_k=ctk, type_v=ctk)
    if form is not None:
        engine.runner.latent_forms.fixed = _fixed(form)
    if mla:
        assert engine.kv.v_in_k and engine.kv.n_bytes == 512 * 4 * {"f16": 2 * 576, "q8_0": 576 // 32 * 34}[ctk]
    _check(want, _run(engine, tokens), f"GPU -mla {mla} ub {ubatch} {ctk} prompt form {form or 'timed'}")


def test_mode_3_times_both_forms_per_size_class_and_keeps_the_faster(lite):
    """The first u-batches of each (tokens, cells) class run 1 + 3 layers absorbed, then 1 + 3 expanded, timed
    (CUDA events); the class keeps the faster form, and later u-batches of it run only that one. The 4-layer model
    needs two 100-token prompts for its class (128 tokens, 128 cells)."""
    path, tokens, want = lite
    model = load_model(GGUFFile(path), mla=3)
    e = Engine(model, CudaBackend(), n_ctx=512, n_ubatch=128)
    forms = e.runner.latent_forms
    for _ in range(2):
        e.truncate(0)
        e.decode(tokens[:100])
    trials = forms.explorer.trials[128, 128]
    assert {k: len(v) for k, v in trials.items()} == {"absorbed": 4, "expanded": 4}
    chosen = forms.explorer.chosen[128, 128]
    assert chosen == min(trials, key=lambda k: min(trials[k][1:]))
    print(f"\n100 tokens over 100 cells: {forms.explorer.why(100, 100)}; kept {chosen}")
    e.truncate(0)
    kept = e.decode(tokens[:100], all_logits=True)
    assert {k: len(v) for k, v in forms.explorer.trials[128, 128].items()} == {"absorbed": 4, "expanded": 4}
    fixed = Engine(model, CudaBackend(), n_ctx=512, n_ubatch=128)
    fixed.runner.latent_forms.fixed = _fixed(chosen)
    assert torch.equal(kept, fixed.decode(tokens[:100], all_logits=True))


@pytest.mark.parametrize("mla", [1, 3])
def test_graph_decoding_equals_eager_decoding(lite, mla):
    path, tokens, _ = lite
    model = load_model(GGUFFile(path), mla=mla)
    backend = CudaBackend()
    out = []
    for graphs in (True, False):
        e = Engine(model, backend, n_ctx=512)
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        e.runner.latent_forms.fixed = _fixed("expanded")  # not timed: both runs take the same form
        out.append(_run(e, tokens))
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("policy", ["all=off", "all=on"])
@pytest.mark.parametrize("ubatch", [512, 64])  # 64: the prompt's u-batches taken layer first
def test_experts_in_ram_match_the_cpu(lite, policy, ubatch):
    path, tokens, want = lite
    backend, model = place(path, 8, n_gpu_layers=999, override_tensor=["exps=CPU"], offload_policy=policy, n_ctx=512)
    _check(want, _run(Engine(model, backend, n_ctx=512, n_ubatch=ubatch), tokens),
           f"-ot exps=CPU {policy} -mla 3 ub {ubatch}")


def test_amb_splits_heads_on_the_gpu(lite):
    path, tokens, want = lite
    model = load_model(GGUFFile(path), mla=3, max_batch_mib=1)  # 6 * 300 * 320 bytes per head: 1 head at a time
    assert model.latent_layers()[0].heads_at_once(300) == 1
    engine = Engine(model, CudaBackend(), n_ctx=512, n_ubatch=512)
    engine.runner.latent_forms.fixed = _fixed("expanded")  # -amb bounds the expanded form only
    _check(want, _run(engine, tokens), "GPU -mla 3 -amb 1")


@pytest.mark.parametrize("mla,where", [(0, "GPU"), (1, "GPU"), (3, "GPU"), (3, "all=off"), (3, "all=on")])
def test_prompt_graphs_equal_eager_prompts(lite, mla, where):
    """u-batches of 200 tokens replayed as graphs cut at the cache-sized work give the bits of eager ones, all on
    the GPU and with the experts in RAM (graphs between host steps). Mode 3's form is set by a rule under which one
    recorded shape runs both: absorbed over 200 and 400 cells (the first run, eager, then the first replay),
    expanded over 600 (the second replay)."""
    path, tokens, _ = lite
    out = []
    for graphs in (True, False):
        if where == "GPU":
            model, backend = load_model(GGUFFile(path), mla=mla), CudaBackend()
        else:
            backend, model = place(path, 8, n_gpu_layers=999, override_tensor=["exps=CPU"], offload_policy=where,
                                              n_ctx=1024)
        e = Engine(model, backend, n_ctx=1024, n_ubatch=200, layer_first=False)  # u-batches recorded one by one
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        e.runner.latent_forms.fixed = lambda n_tokens, n_kv: "expanded" if n_kv > 500 else "absorbed"
        out.append(e.decode(tokens[:N_PROMPT] * 2, all_logits=True))
    assert torch.equal(out[0], out[1])
