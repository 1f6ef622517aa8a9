"""The command line: the real default model, synth files, one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from ferry.gguf.file import GGUFFile
from ferry.models import load_model



def ferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferry", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_run_on_the_embedded_gemma_answers_a_factual_prompt():
    r = ferry("run", "The capital of Germany is Berlin. The capital of France is", "--temp", "0", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of Germany is Berlin. The capital of France is Paris")
    assert "prompt eval time" in r.stderr and "tokens per second" in r.stderr


def test_run_greedy_is_deterministic_and_prints_timings(tiny):
    runs = [ferry("run", "-m", str(tiny), "hello", "--temp", "0", "-n", "5") for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout
    assert "eval time" in runs[0].stderr and "experts hit per layer" in runs[0].stderr


def test_seeded_sampling_is_reproducible(tiny):
    a, b = (ferry("run", "-m", str(tiny), "hi", "-s", "7", "--temp", "1.5", "-n", "6", "-q") for _ in range(2))
    assert a.returncode == 0 and a.stdout == b.stdout


@pytest.mark.parametrize("args,message", [
    (["run", "-m", "/nonexistent/model.gguf", "hi"], "no such file"),
    (["run", "-m", "{tiny}"], "no prompt"),
    (["run", "-m", "{tiny}", "a long prompt of many words", "-c", "3"], "context is full"),
    (["run", "-m", "{tiny}", "hi", "-t", "-2"], "-t/--threads must be 1..1024"),
    (["run", "-m", "{tiny}", "hi", "-tb", "5000"], "-tb/--threads-batch must be 1..1024"),
    (["run", "-m", "{tiny}", "hi", "--top-p", "0"], "--top-p must be"),
    (["run", "--no-such-flag"], "unrecognized arguments"),
    (["run", "-m", "{tiny}", "hi", "-ctk", "q9"], "-ctk/--cache-type-k: unknown KV cache type 'q9'; valid types: f32, f16"),
    (["bench", "-m", "{tiny}", "-ctv", "f8"], "-ctv/--cache-type-v: unknown KV cache type 'f8'"),
    (["info", "{tiny}", "-ot", "exps"], "is not REGEX=DEVICE"),
    (["info", "{tiny}", "-ot", "exps=GPU"], "unknown device"),
    (["run", "-m", "{tiny}", "hi", "--offload-policy", "mul_mat_idd=on"], "unknown op 'mul_mat_idd'; valid names: all"),
    (["run", "-m", "{tiny}", "hi", "--offload-min-batch", "0"], "--offload-min-batch must be at least 1"),
    (["bench", "-m", "{tiny}", "-ngl", "999", "-ot", "exps=CUDA1"], "needs a CUDA GPU"),
    (["plan", "-m", "{tiny}", "--offload-policy", "27,0"], "is neither a mode"),
    (["synth", "no-such-preset", "-o", "x.gguf"], "unknown preset"),
    (["synth", "qwen3-moe-tiny", "-o", "x.gguf", "--type", "q9_9"], "unknown quant type"),
    (["synth", "qwen3-moe-tiny", "-o", "x.gguf", "--expert-type", "q4_k_x"], "or a mix: q4_k_m, q5_k_m"),
])
def test_user_errors_are_one_line_with_exit_code_2(tiny, args, message):
    r = ferry(*[a.replace("{tiny}", str(tiny)) for a in args])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr


def test_synth_into_a_missing_folder_leaves_no_file(tmp_path):
    r = ferry("synth", "qwen3-moe-tiny", "-o", str(tmp_path / "no" / "x.gguf"), "-q")
    assert r.returncode == 2 and "cannot write" in r.stderr
    assert not any(tmp_path.rglob("*"))


def test_info_json_reports_placement(tiny):
    r = ferry("info", str(tiny), "-ngl", "999", "-ot", "exps=CPU", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["architecture"] == "qwen3moe"
    devices = {g["group"]: g["device"] for g in report["tensor_groups"]}
    assert devices["blk.*.ffn_up_exps.weight"] == "CPU"
    assert devices["blk.*.attn_q.weight"] == "CUDA0"
    assert devices["token_embd.weight"] == "CPU"


def test_info_says_which_cpu_tensors_are_repacked(tiny):
    def layouts(*extra):
        r = ferry("info", str(tiny), "--json", *extra)
        assert r.returncode == 0, r.stderr
        return {g["group"]: g["cpu_layout"] for g in json.loads(r.stdout)["tensor_groups"]}

    default = layouts("-ot", "attn=CUDA0")
    # Q4_0 experts with rows a multiple of 8 have ggml's interleaved layout; f32 norms do not; GPU tensors have none
    assert default["blk.*.ffn_up_exps.weight"] == "repacked" and default["blk.*.ffn_norm.weight"] == "mmap"
    assert default["blk.*.attn_q.weight"] == ""
    assert set(layouts("--no-repack").values()) == {"mmap"}
    r = ferry("info", str(tiny))
    assert "repacked: copied at load into ggml's interleaved CPU layout" in r.stdout


def test_a_transformers_without_a_converter_for_the_architecture_says_which_version_to_install(monkeypatch, tiny):
    """Older transformers (5.17) key their GGUF tokenizer converters by architecture (no deepseek2 there): an error
    naming the version ferry is tested with, not 'not supported'."""
    import ferry.tokenizer as tokenizer
    from ferry.errors import FerryError
    from ferry.gguf.file import GGUFFile

    f = GGUFFile(tiny)

    def by_architecture(architecture, meta):
        raise KeyError(architecture)

    monkeypatch.setattr(tokenizer, "_converter", lambda: by_architecture)
    with pytest.raises(FerryError, match=f"builds no tokenizer for '{f.architecture}' files.*transformers==5.23"):
        tokenizer.Tokenizer(f)


def test_a_transformers_without_the_tokenizer_converter_is_one_clear_error(monkeypatch):
    from ferry.errors import FerryError
    from ferry.tokenizer import _converter

    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.gguf_tokenizer_mapping", None)
    monkeypatch.setitem(sys.modules, "transformers.integrations.ggml", None)
    with pytest.raises(FerryError, match="no convert_gguf_tokenizer.*transformers==5.23"):
        _converter()


def test_mla_modes_from_the_command_line(tmp_path):
    path = tmp_path / "ds.gguf"
    assert ferry("synth", "deepseek2-tiny", "-o", str(path), "-q").returncode == 0
    plans = {m: json.loads(ferry("plan", "-m", str(path), "-mla", m, "--json").stdout) for m in ("0", "2")}
    # deepseek2-tiny: 4 layers; expanded: 4 heads x (48 + 32) values, latent: 64 + 16, both f16
    assert plans["0"]["kv_bytes_per_token"] == 4 * 2 * 4 * (48 + 32)
    assert plans["2"]["kv_bytes_per_token"] == 4 * 2 * (64 + 16) and plans["2"]["mla"] == 2
    assert json.loads(ferry("plan", "-m", str(path), "--json").stdout)["mla"] == 3  # no flag: ferry's choice
    info = json.loads(ferry("info", str(path), "--json").stdout)
    assert (info["mla"], info["kv_bytes_per_token_f16"]) == (3, plans["2"]["kv_bytes_per_token"])
    expanded = plans["0"]["kv_bytes_per_token"]
    assert f"KV cache: {expanded} bytes per token in f16 (-mla 0" in ferry("info", str(path), "-mla", "0").stdout
    # mode 3 says how it picks a prompt's form: deepseek2-tiny's multiply-add crossover (lora 64, nope 32, v 32:
    # 64 * 64 / (128 - 64) = 64 tokens, as its layers compute it), the GPU's timing
    cpu_from = load_model(GGUFFile(path)).latent_layers()[0].expand_from
    says = ferry("plan", "-m", str(path)).stdout
    assert cpu_from == 64 and "on a GPU as timed on the first u-batches of each size and cache length" in says, says
    assert f"on the CPU from {cpu_from} tokens" in says, says
    r = ferry("run", "-m", str(path), "hi", "-n", "3", "--temp", "0", "-mla", "1", "-amb", "64")
    assert r.returncode == 0, r.stderr
    for bad, says in ((["-mla", "5"], "-mla 5: valid modes"), (["-amb", "-2"], "-amb -2")):
        r = ferry("run", "-m", str(path), "hi", *bad)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
