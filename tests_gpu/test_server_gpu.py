"""ferry serve on the GPU and in hybrid: the prompt cache, the RAM prompt cache and prompts mixed into the decode steps,
as tests/test_server.py checks them on the CPU."""

import pytest

from benchmarks.serve_load import load
from benchmarks.serve_prefill import ram_conversation, serve
from ferry.cli import main

PLACEMENTS = [["-ngl", "999"], ["-ngl", "999", "-ot", "exps=CPU"]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    assert main(["synth", "qwen3-moe-tiny", "-o", str(path), "-q"]) == 0
    return path


@pytest.mark.parametrize("flags", PLACEMENTS)
def test_a_conversation_comes_back_from_the_ram_cache_as_from_its_slot(tiny, flags):
    """As tests/test_server.py's RAM cache test: a conversation written over in its one slot comes back from RAM and
    generates exactly what it generates in a slot never written over."""
    kept = ram_conversation(tiny, "2", "64", False, flags, threads="4")
    back = ram_conversation(tiny, "1", "64", True, flags, threads="4")
    assert back["timings"]["cache_n"] == kept["timings"]["cache_n"] > 8
    assert back["choices"][0]["text"] == kept["choices"][0]["text"]


@pytest.mark.parametrize("flags", PLACEMENTS)
def test_clients_under_load_get_their_answers_alone(tiny, flags):
    """benchmarks/serve_load.py's check for 10 s: prompts mixed into other slots' steps and reused from caches give
    each prompt's answer alone, up to a near tie; nothing fails; every slot is free afterwards."""
    url, srv, thread = serve(["-m", str(tiny), "-np", "4", "-c", "8192", "-t", "4", "--cache-ram", "32", *flags])
    try:
        r = load(url, clients=16, seconds=10)
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    assert r["wrong"] == 0 and r["failed"] == 0, r["errors"]
    assert r["completed"] > 20 and r["slots_processing_after"] == 0
