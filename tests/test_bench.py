"""ferry bench: llama-bench's list syntax, one row per combination, and output formats that parse back."""

import csv
import io
import json
import subprocess
import sys

import pytest

from ferry.errors import FerryError
from ferry.tools.bench import parse_int_list


@pytest.mark.parametrize("text,values", [
    ("512", [512]), ("128,512", [128, 512]), ("1-4", [1, 2, 3, 4]), ("8-32+8", [8, 16, 24, 32]),
    ("128-1024*2", [128, 256, 512, 1024]), ("1,4-6", [1, 4, 5, 6]),
])
def test_int_lists_follow_llama_bench(text, values):
    assert parse_int_list("-p", text) == values


@pytest.mark.parametrize("text", ["x", "1-", "8-4", "0-8*2", "4-8*1", "-3"])
def test_bad_int_lists_are_user_errors(text):
    with pytest.raises(FerryError, match="-p"):
        parse_int_list("-p", text)


def bench(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "ferry", "bench", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_json_has_one_row_per_combination_with_repetitions(tiny):
    rows = json.loads(bench("-m", str(tiny), "-p", "16,32", "-n", "4", "-ub", "8,32", "-r", "3", "-t", "1", "-o", "json"))
    assert [(r["test"], r["n_ubatch"]) for r in rows] == [
        ("pp16", 8), ("pp32", 8), ("tg4", 8), ("pp16", 32), ("pp32", 32), ("tg4", 32)]
    for r in rows:
        assert len(r["samples_ts"]) == 3 and r["avg_ts"] > 0 and r["n_threads"] == 1
        # a prompt of random tokens reaches several of the 16 experts in each of the 4 layers
        assert (len(r["experts_hit"]) == 4 and min(r["experts_hit"]) > 4) if r["n_prompt"] else r["experts_hit"] == []


def test_markdown_and_csv_parse_back(tiny):
    md = bench("-m", str(tiny), "-p", "16", "-n", "2", "-r", "2", "-ctk", "q8_0").strip().splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in md[2:]]
    assert [r["test"] for r in rows] == ["pp16", "tg2"] and {r["type_k"] + "/" + r["type_v"] for r in rows} == {"q8_0/f16"}
    assert all(float(r["t/s"].split("±")[0]) > 0 for r in rows)
    rows = list(csv.DictReader(io.StringIO(bench("-m", str(tiny), "-p", "16", "-n", "0", "-r", "2", "-o", "csv"))))
    assert len(rows) == 1 and rows[0]["test"] == "pp16" and len(json.loads(rows[0]["samples_ts"])) == 2


def test_prompt_plus_generation_and_depth_rows(tiny):
    rows = json.loads(bench("-m", str(tiny), "-p", "0", "-n", "4", "-pg", "16,4", "-d", "0,32", "-r", "2", "-o", "json"))
    assert [r["test"] for r in rows] == ["tg4", "tg4 @ d32", "pp16+tg4", "pp16+tg4 @ d32"]
    assert [r["n_depth"] for r in rows] == [0, 32, 0, 32] and all(r["avg_ts"] > 0 for r in rows)
    # the prompt part of pp+tg routes to experts, a lone generation reports none
    assert rows[0]["experts_hit"] == [] and len(rows[2]["experts_hit"]) == 4


@pytest.mark.parametrize("args,message", [
    (["-fa", "0"], "always uses flash attention"),
    (["-ngl", "2"], "needs a CUDA GPU and torch sees none"),
    (["-ot", "exps=CUDA0"], "needs a CUDA GPU and torch sees none"),
    (["-ot", "exps=GPU"], "unknown device 'GPU'; use CPU, CUDA0, CUDA1"),
    (["-pg", "512"], "is not a pair like 512,128"),
])
def test_bench_flags_it_cannot_honour_are_errors_before_any_output(tiny, args, message):
    r = subprocess.run([sys.executable, "-m", "ferry", "bench", "-m", str(tiny), *args], capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""


def test_bench_reports_its_progress_run_by_run(tiny):
    """What `ferry bench` shows on a terminal: after each test, its runs (the warm-up included) done of all."""
    from ferry.runtime.loader import RunConfig
    from ferry.tools.bench import run_bench

    seen = []
    rows = run_bench([RunConfig(tiny, n_threads=1, quiet=True)], [16], [2], [2048], [512, 8], 2,
                     on_progress=lambda done, total, note: seen.append((done, total, note)))
    assert [r.n_ubatch for r in rows] == [512, 512, 8, 8]
    assert seen == [(3, 12, "pp16"), (6, 12, "tg2"), (9, 12, "pp16"), (12, 12, "tg2")]
