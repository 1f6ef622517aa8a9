"""Routing statistics: how often a text routes to each expert of each MoE layer (`ferry calibrate --routing`), stored
beside the calibration and keyed by the model file, so that a placement can put the most used experts on the GPU
first. The text is cut into -c chunks as `ferry ppl` cuts it; the last fifth is held out, and the report says what
share of its routed (token, expert) pairs the experts most used in the rest would have caught, against the share
of experts they are (what uniform routing would give)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from ferry.config import settings
from ferry.errors import FerryError
from ferry.files import atomic_file

HELD_OUT = 0.2  # the share of the text's tokens kept out of the counts, to test them on
SHARES = (0.1, 0.25, 0.5)  # shares of each layer's experts the report tries as a resident set
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(?:gate|up|down)_exps\.weight$")


def model_key(path: Path) -> str:
    """A key of the model file's contents (its size and first 4 MiB: the header, the tensors' names, types and
    offsets), not of its name or where it lies."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
    return h.hexdigest()[:16]


def default_path(model: Path) -> Path:
    """Where `ferry calibrate --routing` stores a model's counts (in Settings.cache_dir, beside the calibration)."""
    return settings().cache_dir / f"routing-{model_key(model)}.json"


def moe_layers(tensor_names) -> list[int]:
    """The layers that have routed experts, in order: the order of a run's per-MoE-layer routing."""
    return sorted({int(m.group(1)) for name in tensor_names if (m := _EXPERTS_RE.match(name))})


def count(engine, tokens: list[int], n_ctx: int, n_layers: int, n_expert: int, bos: int | None = None,
          on_chunk=None) -> np.ndarray:
    """(n_layers, n_expert) counts of the (token, expert) pairs the text's tokens routed to, each -c chunk decoded
    from an empty cache (its first token BOS where the model adds one, as `ferry ppl` does); a last chunk of at
    least 2 tokens counts too."""
    counts = np.zeros((n_layers, n_expert), dtype=np.int64)
    starts = list(range(0, len(tokens) - 1, n_ctx))
    for i, s in enumerate(starts):
        chunk = list(tokens[s:s + n_ctx])
        if len(chunk) < 2:
            break
        if bos is not None:
            chunk[0] = bos
        engine.reset()
        engine.decode(chunk)
        for routing in engine.take_routing():
            if len(routing) != n_layers:
                raise FerryError(f"the run routed {len(routing)} MoE layers, the file has {n_layers}: this "
                                 "architecture's routing cannot be counted yet")
            for layer, ids in enumerate(routing):
                counts[layer] += np.bincount(ids.flatten().long().numpy(), minlength=n_expert)[:n_expert]
        if on_chunk:
            on_chunk(i + 1, len(starts))
    return counts


def coverage(counted: np.ndarray, held: np.ndarray, shares=SHARES) -> list[dict]:
    """For each share of experts per layer, the held-out pairs that the most counted experts of each layer catch."""
    out = []
    order = np.argsort(-counted, axis=1, kind="stable")
    for share in shares:
        k = max(1, round(share * counted.shape[1]))
        caught = np.take_along_axis(held, order[:, :k], axis=1).sum()
        out.append({"experts": k / counted.shape[1], "per_layer": k, "pairs": float(caught / max(held.sum(), 1))})
    return out


def measure(engine, tokens: list[int], n_ctx: int, n_layers: int, n_expert: int, bos: int | None = None,
            on_chunk=None) -> dict:
    """The counts over all but the last fifth of the tokens, and that fifth's coverage by them."""
    cut = int(len(tokens) * (1 - HELD_OUT))
    if cut < 2 or len(tokens) - cut < 2:
        raise FerryError(f"the text has {len(tokens)} tokens: too few to count routing and hold a fifth out; give "
                         "a longer text")
    counted = count(engine, tokens[:cut], n_ctx, n_layers, n_expert, bos, on_chunk)
    held = count(engine, tokens[cut:], n_ctx, n_layers, n_expert, bos)
    return {"counts": counted.tolist(), "held_counts": held.tolist(), "tokens": cut, "held_out_tokens": len(tokens) - cut,
            "coverage": coverage(counted, held)}


def save(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1))


def load(model: Path, path: Path | None = None) -> dict | None:
    """The counts stored for this model file (None where there are none); a FerryError where `path` holds another
    model's."""
    path = path or default_path(model)
    if not path.exists():
        return None
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FerryError(f"{path}: not a routing count ({e}); run `ferry calibrate --routing` again") from None
    if result.get("key") != model_key(model):
        raise FerryError(f"{path} counts the routing of another file ({result.get('model')}); run `ferry calibrate "
                         f"--routing -m {model}` for this one")
    return result


def table(result: dict) -> str:
    counts = np.asarray(result["counts"])
    per_layer = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    top = np.sort(per_layer, axis=1)[:, ::-1]
    head = (f"routing of {result['model']}: {result['tokens']} tokens counted over {len(result['layers'])} MoE layers "
            f"of {result['n_expert']} experts ({result['n_expert_used']} per token); the busiest expert of a layer "
            f"takes {100 * top[:, 0].min():.1f}-{100 * top[:, 0].max():.1f}% of its pairs")
    lines = [head, f"held out ({result['held_out_tokens']} tokens): the experts most used in the counted text catch",
             "| experts per layer | share of experts | share of held-out pairs |", "| ---: | ---: | ---: |"]
    lines += [f"| {c['per_layer']} | {100 * c['experts']:.1f}% | {100 * c['pairs']:.1f}% |" for c in result["coverage"]]
    return "\n".join(lines)
