"""ferry sweep: llama-sweep-bench's table (a format contract), its JSON, plots, and the cache rollback it uses."""

import json

import numpy as np
import torch

from ferry.cli import main
from ferry.gguf.file import GGUFFile
from ferry.models import load_model
from ferry.runtime.engine import Engine
from ferry.tools.sweep import HEADER


def test_sweep_prints_the_sweep_bench_table_and_writes_json(tiny, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["sweep", "-m", str(tiny), "-c", "640", "-ub", "128", "-t", "1", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "\n".join(lines[:2]) == HEADER
    cells = [[float(c) for c in line.strip("|").split("|")] for line in lines[2:]]
    # steps at N_KV 0, 128, ..., 512: each has room for a 128-token u-batch in -c 640
    assert [int(c[2]) for c in cells] == [0, 128, 256, 384, 512]
    assert all(int(c[0]) == 128 and int(c[1]) == 32 and c[3] > 0 and c[5] > 0 for c in cells)
    data = json.loads(out.read_text())
    assert data["n_ubatch"] == 128 and [r["n_kv"] for r in data["rows"]] == [0, 128, 256, 384, 512]
    for c, r in zip(cells, data["rows"]):  # the table prints the JSON's numbers, and speed = tokens / time
        assert abs(c[3] - r["t_pp"]) <= 5e-4 and abs(c[4] - r["s_pp"]) <= 5e-3 and abs(c[6] - r["s_tg"]) <= 5e-3
        assert r["s_pp"] == r["pp"] / r["t_pp"] and r["s_tg"] == r["tg"] / r["t_tg"]


def test_plot_overlays_runs_into_a_png(tiny, tmp_path):
    a, png = tmp_path / "a.json", tmp_path / "p.png"
    assert main(["sweep", "-m", str(tiny), "-c", "256", "-ub", "64", "-t", "1", "--json", str(a), "-q"]) == 0
    assert main(["sweep", "--no-run", "--overlay", str(a), "--overlay", str(a), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_user_errors(tiny, capsys):
    assert main(["sweep", "-m", str(tiny), "-c", "100", "-ub", "128"]) == 2
    assert "raise -c to at least 160" in capsys.readouterr().err
    assert main(["sweep", "--no-run", "--plot", "x.png"]) == 2
    assert "--no-run only plots" in capsys.readouterr().err


def test_truncate_forgets_positions_like_they_were_never_decoded(tiny, backend):
    model = load_model(GGUFFile(tiny))
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, model.args.n_vocab, n).tolist() for n in (40, 17, 9))
    e = Engine(model, backend, n_ctx=128)
    e.decode(a)
    e.decode(b)
    e.truncate(len(a))
    rolled_back = e.decode(c, all_logits=True)
    fresh = Engine(model, backend, n_ctx=128)
    fresh.decode(a)
    assert torch.equal(rolled_back, fresh.decode(c, all_logits=True))
