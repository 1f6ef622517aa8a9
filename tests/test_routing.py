"""Routing statistics (`ferry calibrate --routing`, offload/routing.py) and skewed synthetic routing (`ferry synth
--routing-skew`): counts checked against a second runner and by their sums, the held-out coverage by hand, the
store keyed by the file, the skew's effect and that it leaves every other weight alone."""

import json

import numpy as np
import pytest
import torch

from ferry.cli import main
from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.gguf.synth import PRESETS, synth
from ferry.models import load_model
from ferry.offload import routing
from ferry.quant import Q
from ferry.runtime.engine import Engine

TEXT = " ".join(f"The {w} river {i} carries {i % 11} stones past the {w} mill." for i, w in
                enumerate(["red", "old", "quiet", "long", "cold", "north"] * 20))


@pytest.fixture(scope="module")
def skewed_pair(tmp_path_factory):
    """qwen3-moe-tiny written twice from one seed: routing as it is, and skewed."""
    d = tmp_path_factory.mktemp("skew")
    paths = (d / "even.gguf", d / "skewed.gguf")
    for path, skew in zip(paths, (0.0, 3.0)):
        synth(PRESETS["qwen3-moe-tiny"], path, Q.Q4_0, Q.Q8_0, quiet=True, routing_skew=skew)
    return paths


def _engine(path, backend, graph=True):
    model = load_model(GGUFFile(path))
    return model, Engine(model, backend, n_ctx=64, n_ubatch=64, graph=graph)


def _tokens(model, n=300):
    return torch.randint(0, model.args.n_vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def test_counts_are_every_routed_pair_and_agree_between_runners(tiny, backend):
    model, graph = _engine(tiny, backend)
    tokens = _tokens(model)
    layers = routing.moe_layers(GGUFFile(tiny).tensors)
    assert layers == list(range(model.args.n_layer_dense_lead, model.args.n_layer))
    a = routing.count(graph, tokens, 64, len(layers), model.args.n_expert, bos=1)
    # chunks of 64 from 300 tokens: 4 whole and one of 44, every token routed to n_expert_used experts per layer
    assert a.shape == (len(layers), model.args.n_expert)
    assert (a.sum(1) == 300 * model.args.n_expert_used).all()
    _, eager = _engine(tiny, backend, graph=False)  # op by op, another path through the same routing
    b = routing.count(eager, tokens, 64, len(layers), model.args.n_expert, bos=1)
    moved = np.abs(a - b).sum() / 2 / a.sum()
    assert moved < 0.01, f"{moved:.3%} of the pairs routed elsewhere by the eager runner"
    c = routing.count(graph, tokens[:129], 64, len(layers), model.args.n_expert)
    assert (c.sum(1) == 128 * model.args.n_expert_used).all()  # a last chunk of one token routes nothing


def test_coverage_is_the_held_out_pairs_of_the_most_counted_experts():
    counted = np.array([[5, 1, 9, 0], [0, 7, 2, 3]])
    held = np.array([[2, 4, 6, 8], [1, 1, 1, 1]])
    rows = routing.coverage(counted, held, shares=(0.25, 0.5))
    # layer 0's top experts are 2 then 0; layer 1's are 1 then 3
    assert rows[0] == {"experts": 0.25, "per_layer": 1, "pairs": (6 + 1) / 24}
    assert rows[1] == {"experts": 0.5, "per_layer": 2, "pairs": (6 + 2 + 1 + 1) / 24}


def test_skew_concentrates_routing_and_changes_only_the_routers(skewed_pair, backend):
    even, skewed = (GGUFFile(p) for p in skewed_pair)
    for name, t in even.tensors.items():
        same = np.array_equal(even.data(t), skewed.data(name))
        assert same != name.endswith("ffn_gate_inp.weight"), name
    shares = []
    for path in skewed_pair:
        model, engine = _engine(path, backend)
        tokens = _tokens(model, 1000)
        r = routing.measure(engine, tokens, 64, model.args.n_layer, model.args.n_expert)
        shares.append(r["coverage"][1]["pairs"])  # a quarter of each layer's experts
    # a quarter of the experts (4 of 16, 4 used per token): 0.25 of the pairs as written, 0.49 with skew 3
    assert shares[1] > shares[0] + 0.15, shares


def test_the_store_is_keyed_by_the_file(tmp_path, skewed_pair):
    even, skewed = skewed_pair
    assert routing.model_key(even) != routing.model_key(skewed)
    path = tmp_path / "r.json"
    routing.save({"model": even.name, "key": routing.model_key(even), "counts": [[1]]}, path)
    assert routing.load(even, path)["counts"] == [[1]]
    with pytest.raises(FerryError, match="another file"):
        routing.load(skewed, path)
    assert routing.load(even, tmp_path / "none.json") is None


def test_calibrate_routing_command(tiny, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "routing.json"
    assert main(["calibrate", "--routing", "-m", str(tiny), "-f", str(text), "-c", "64", "-t", "1",
                 "--out", str(out), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "held out" in printed and "| experts per layer |" in printed
    r = json.loads(out.read_text())
    assert r["key"] == routing.model_key(tiny) and r["n_expert"] == len(r["counts"][0])
    assert sum(r["counts"][0]) == r["tokens"] * r["n_expert_used"]
    assert routing.load(tiny, out) == r


@pytest.mark.parametrize("args, message", [
    (["calibrate", "--routing", "-m", "{tiny}"], "give -m MODEL.gguf and -f TEXT"),
    (["calibrate", "-f", "{tmp}/t.txt"], "add --routing"),
    (["calibrate", "--routing", "-m", "{tiny}", "-f", "{tmp}/missing.txt"], "-f {tmp}/missing.txt"),
    (["synth", "qwen3-moe-tiny", "-o", "{tmp}/x.gguf", "--routing-skew", "-1"], "--routing-skew must be"),
])
def test_routing_mistakes_are_one_line(tiny, tmp_path, capsys, args, message):
    args = [a.format(tiny=tiny, tmp=tmp_path) for a in args]
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message.format(tmp=tmp_path) in err and len(err.splitlines()) == 1
