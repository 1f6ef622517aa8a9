"""`ferry ppl`: perplexity over a text with llama-perplexity's method (the tokens cut into -c chunks, each
chunk's first token replaced by BOS where the model adds one, only the second half of each chunk scored,
PPL +/- its standard error), and KL-divergence against log-probabilities saved from a base run."""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ferry.errors import FerryError
from ferry.files import atomic_file

PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0)


@dataclass
class PplResult:
    n_ctx: int
    n_chunks: int
    n_scored: int
    ppl: float
    ppl_err: float
    chunk_ppl: list[float] = field(default_factory=list)  # running estimate after each chunk
    kl: dict | None = None  # with a base: KLD and agreement statistics


def chunks(tokens: list[int], n_ctx: int, max_chunks: int = -1) -> int:
    n = len(tokens) // n_ctx
    if max_chunks > 0:
        n = min(n, max_chunks)
    if n < 1:
        raise FerryError(f"the text has {len(tokens)} tokens, fewer than one chunk of -c {n_ctx}; give a longer "
                         "text or a smaller -c")
    return n


def _scored_logprobs(engine, chunk: list[int]) -> torch.Tensor:
    """log-softmax rows that predict chunk[first+1:], first = n_ctx / 2 (float32, (n_ctx - first - 1, n_vocab))."""
    first = len(chunk) // 2
    engine.reset()
    engine.decode(chunk[:first])  # context only: no logits kept
    logits = engine.decode(chunk[first:], all_logits=True)[:-1]
    return torch.log_softmax(logits.double(), -1).float()


def _ppl(nll: np.ndarray) -> tuple[float, float]:
    """exp(mean NLL) and its standard error by the delta method (llama-perplexity's estimate)."""
    mean = float(nll.mean())
    var = float((nll ** 2).mean() - mean ** 2)
    ppl = math.exp(mean)
    return ppl, (math.sqrt(var / (len(nll) - 1)) * ppl if var > 0 and len(nll) > 1 else 0.0)


def perplexity(engine, tokens: list[int], n_ctx: int, bos_id: int | None, max_chunks: int = -1,
               save_base: Path | None = None, base: dict | None = None, on_chunk=None) -> PplResult:
    n_chunks = chunks(tokens, n_ctx, max_chunks)
    if base is not None:
        n_chunks = min(n_chunks, base["n_chunks"])
    nll_all, saved, kld_all, same_top = [], [], [], []
    running = []
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        logprobs = _scored_logprobs(engine, chunk)
        targets = torch.tensor(chunk[n_ctx // 2 + 1:])
        nll_all.append(-logprobs.gather(1, targets[:, None])[:, 0].numpy().astype(np.float64))
        if save_base is not None:
            saved.append(logprobs.half().numpy())
        if base is not None:
            b = torch.from_numpy(base["logprobs"][i * len(targets):(i + 1) * len(targets)].astype(np.float32))
            kld_all.append((b.exp() * (b - logprobs)).sum(-1).double().numpy())
            same_top.append((b.argmax(-1) == logprobs.argmax(-1)).numpy())
        ppl, _ = _ppl(np.concatenate(nll_all))
        running.append(ppl)
        if on_chunk:
            on_chunk(i, ppl)
    nll = np.concatenate(nll_all)
    ppl, err = _ppl(nll)
    result = PplResult(n_ctx, n_chunks, len(nll), ppl, err, running)
    if save_base is not None:
        _save_base(save_base, np.concatenate(saved), tokens, n_ctx, n_chunks)
    if base is not None:
        result.kl = _kl_stats(np.concatenate(kld_all), np.concatenate(same_top), nll, base, n_chunks * (n_ctx - n_ctx // 2 - 1))
    return result


def _kl_stats(kld: np.ndarray, same: np.ndarray, nll: np.ndarray, base: dict, n: int) -> dict:
    base_nll = base["nll"][:n]
    ppl_base, _ = _ppl(base_nll)
    ppl_q, _ = _ppl(nll)
    p = same.mean()
    return {
        "ppl": ppl_q, "ppl_base": ppl_base, "ppl_ratio": ppl_q / ppl_base, "ppl_diff": ppl_q - ppl_base,
        "kld_mean": float(kld.mean()), "kld_err": float(kld.std(ddof=1) / math.sqrt(len(kld))) if len(kld) > 1 else 0.0,
        "kld_max": float(kld.max()), "kld_min": float(kld.min()),
        "kld_percentiles": {str(q): float(np.percentile(kld, q)) for q in PERCENTILES},
        "same_top_p": float(p), "same_top_p_err": float(math.sqrt(p * (1 - p) / len(same))),
    }


def _save_base(path: Path, logprobs: np.ndarray, tokens: list[int], n_ctx: int, n_chunks: int) -> None:
    """One .npz (zip) written whole or not at all: float16 log-probabilities of the scored positions,
    the tokens and the chunking."""
    with atomic_file(path) as tmp, zipfile.ZipFile(tmp, "w") as z:
        for name, arr in (("logprobs", logprobs), ("tokens", np.asarray(tokens, dtype=np.int32)),
                          ("chunking", np.asarray([n_ctx, n_chunks], dtype=np.int64))):
            buf = io.BytesIO()
            np.save(buf, arr)
            z.writestr(name + ".npy", buf.getvalue())


def load_base(path: Path, tokens: list[int], n_ctx: int) -> dict:
    try:
        with np.load(path) as z:
            base = {k: z[k] for k in ("logprobs", "tokens", "chunking")}
    except FileNotFoundError:
        raise FerryError(f"{path}: no such file; write it first with --kl-divergence-base {path}") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        raise FerryError(f"{path}: not a file written by `ferry ppl --kl-divergence-base`") from None
    base_ctx, base_chunks = (int(v) for v in base["chunking"])
    if base_ctx != n_ctx or base["tokens"].tolist()[:base_ctx * base_chunks] != tokens[:base_ctx * base_chunks]:
        raise FerryError(f"{path} was computed on other tokens or another -c ({base_ctx}); use the same text, "
                         "model vocabulary and -c as the base run")
    first = n_ctx // 2
    targets = np.concatenate([np.asarray(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx]) for i in range(base_chunks)])
    base["nll"] = -base["logprobs"][np.arange(len(targets)), targets].astype(np.float64)
    base["n_chunks"] = base_chunks
    return base


def report(r: PplResult) -> str:
    lines = [f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}"]
    if r.kl:
        k = r.kl
        lines += ["", "====== Perplexity statistics ======",
                  f"Mean PPL(Q)                   : {k['ppl']:10.6f}",
                  f"Mean PPL(base)                : {k['ppl_base']:10.6f}",
                  f"Mean PPL(Q)/PPL(base)         : {k['ppl_ratio']:10.6f}",
                  f"Mean PPL(Q)-PPL(base)         : {k['ppl_diff']:10.6f}",
                  "", "====== KL divergence statistics ======",
                  f"Mean    KLD: {k['kld_mean']:10.6f} ± {k['kld_err']:10.6f}",
                  f"Maximum KLD: {k['kld_max']:10.6f}"]
        lines += [f"{q + '%':<7} KLD: {v:10.6f}" for q, v in k["kld_percentiles"].items()]
        lines += [f"Minimum KLD: {k['kld_min']:10.6f}", "", "====== Token probability statistics ======",
                  f"Same top p: {100 * k['same_top_p']:6.3f} ± {100 * k['same_top_p_err']:5.3f} %"]
    return "\n".join(lines)


def to_json(r: PplResult) -> str:
    return json.dumps(r.__dict__, indent=1)
