"""ferry ppl: llama-perplexity's method checked by hand, its output parsed back, KL-divergence against a base."""

import json
import math
import re

import pytest
import torch

from ferry.cli import main
from ferry.runtime.loader import RunConfig, load
from ferry.runtime.engine import Engine
from ferry.tokenizer import Tokenizer

TEXT = " ".join(f"The {w} number {i} goes to the market and comes back with {i % 7} apples." for i, w in
                enumerate(["first", "second", "third", "fourth", "fifth", "sixth"] * 12))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT)
    return str(path)


def _run(capsys, *args):
    code = main(["ppl", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_perplexity_is_llama_perplexity_method(tiny, text_file, capsys):
    code, out, _ = _run(capsys, "-m", str(tiny), "-f", text_file, "-c", "64", "-t", "1", "-o", "json")
    assert code == 0
    r = json.loads(out)
    # by hand: chunks of 64 tokens, the first replaced by BOS, tokens 33..63 scored from the logits before them
    loaded = load(RunConfig(tiny, n_threads=1))
    f, backend, model = loaded.file, loaded.backend, loaded.model
    tok = Tokenizer(f)
    tokens = tok.encode(TEXT)
    n_chunks = len(tokens) // 64
    nll = []
    for i in range(n_chunks):
        chunk = tokens[i * 64:(i + 1) * 64]
        if tok.add_bos:
            chunk[0] = tok.bos_id
        logits = Engine(model, backend, n_ctx=64).decode(chunk, all_logits=True).double()
        logp = torch.log_softmax(logits, -1)
        nll += [-logp[j, chunk[j + 1]].item() for j in range(32, 63)]
    assert r["n_chunks"] == n_chunks >= 2 and r["n_scored"] == len(nll) == n_chunks * 31
    assert r["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
    assert len(r["chunk_ppl"]) == n_chunks and r["chunk_ppl"][-1] == r["ppl"] and r["ppl_err"] > 0


def test_text_output_and_kl_divergence_against_a_base(tiny, text_file, tmp_path, capsys):
    base = tmp_path / "base.npz"
    code, out, err = _run(capsys, "-m", str(tiny), "-f", text_file, "-c", "64", "--kl-divergence-base", str(base))
    assert code == 0 and re.fullmatch(r"Final estimate: PPL = \d+\.\d{4} \+/- \d+\.\d{5}", out.strip())
    assert re.match(r"perplexity: \d+ tokens, \d+ chunks", err) and "[1]" in err
    ppl = float(out.split()[4])
    # the same settings again: the base's float16 log-probs differ only by their rounding, which can flip the
    # top token where the random model has a near-tie (2 of 217 positions seen)
    code, out, _ = _run(capsys, "-m", str(tiny), "-f", text_file, "-c", "64", "--kl-divergence-base", str(base),
                        "--kl-divergence", "-o", "json")
    same = json.loads(out)["kl"]
    assert same["kld_mean"] < 1e-5 and same["same_top_p"] >= 0.98 and same["ppl_base"] == pytest.approx(ppl, rel=1e-3)
    # a q4_0 cache moves the distribution: KLD above that floor, PPL ratio near 1
    code, out, _ = _run(capsys, "-m", str(tiny), "-f", text_file, "-c", "64", "--kl-divergence-base", str(base),
                        "--kl-divergence", "-ctk", "q4_0", "-ctv", "q4_0")
    assert code == 0 and "Mean    KLD:" in out and "Same top p:" in out
    kld = float(re.search(r"Mean    KLD:\s+([\d.]+)", out).group(1))
    assert kld > 1e-5 and 0.8 < float(re.search(r"PPL\(Q\)/PPL\(base\)\s+:\s+([\d.]+)", out).group(1)) < 1.25


@pytest.mark.parametrize("extra,message", [
    (["-c", "8192"], "fewer than one chunk of -c 8192"),
    (["--kl-divergence"], "--kl-divergence compares with a base"),
    (["--kl-divergence", "--kl-divergence-base", "/nonexistent.npz"], "no such file"),
])
def test_ppl_user_errors(tiny, text_file, capsys, extra, message):
    code, _, err = _run(capsys, "-m", str(tiny), "-f", text_file, *extra)
    assert code == 2 and message in err


def test_base_from_another_context_size_is_refused(tiny, text_file, tmp_path, capsys):
    base = tmp_path / "b.npz"
    assert _run(capsys, "-m", str(tiny), "-f", text_file, "-c", "64", "--kl-divergence-base", str(base))[0] == 0
    code, _, err = _run(capsys, "-m", str(tiny), "-f", text_file, "-c", "32", "--kl-divergence-base", str(base),
                        "--kl-divergence")
    assert code == 2 and "another -c (64)" in err
