"""Which steps the GPU executor records as CUDA graphs, and the host's side of a recording's handshakes: pure
bookkeeping, checked here without a GPU (recording and replaying them is checked on the GPU machine,
tests_gpu/test_model_gpu.py, test_mla_gpu.py and test_hybrid.py)."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ferry.runtime.runners.cuda import DECODE_MAX
from ferry.config import settings
from ferry.kernels.cuda.driver import Handshakes
from ferry.runtime.runners.cuda_graphs import PROMPT_GRAPHS_KEPT, CudaGraphRunner, _Recorder

PROMPT_GRAPH_MAX = settings().prompt_graph_max  # FERRY_PROMPT_GRAPH_MAX


def _executor(graph_safe: bool = True, graphs: bool = True) -> CudaGraphRunner:
    return CudaGraphRunner(SimpleNamespace(device="cpu", graph_safe=graph_safe, host_steps=False,
                                           decided=lambda n: None), graphs=graphs)


def _step(ex: CudaGraphRunner, n: int, ubatches: tuple[int, ...] | None = None) -> bool:
    """One forward's decision (of n tokens; or of a logical batch of these u-batches, taken layer first); a step
    decided to be recorded is captured (a stand-in here)."""
    key = ("model", "cache", n, False, ubatches)
    recorded = ex._recorded(key, max(ubatches), prompt=True) if ubatches else ex._recorded(key, n)
    if recorded and key not in ex._captured:
        ex._captured[key] = object()
    return recorded


def test_decode_steps_are_recorded_from_their_first_run_and_prompts_from_their_second():
    ex = _executor()
    assert _step(ex, 1) and _step(ex, DECODE_MAX)
    assert not _step(ex, 64) and _step(ex, 64) and _step(ex, 64)
    assert not _step(ex, PROMPT_GRAPH_MAX + 1) and not _step(ex, PROMPT_GRAPH_MAX + 1)  # bound by its kernels


def test_a_logical_batch_taken_layer_first_is_recorded_from_its_second_run_by_its_ubatch_sizes():
    """Its shape is its u-batches' sizes: another split of the same rows is another shape; u-batches of decode size
    wait for the second run too (a batch is a prompt), and u-batches past PROMPT_GRAPH_MAX are never recorded."""
    ex = _executor()
    assert not _step(ex, 4096, (512,) * 8) and _step(ex, 4096, (512,) * 8) and _step(ex, 4096, (512,) * 8)
    assert not _step(ex, 4096, (1024,) * 4)
    assert not _step(ex, 16, (DECODE_MAX,) * 2) and _step(ex, 16, (DECODE_MAX,) * 2)
    big = (PROMPT_GRAPH_MAX + 1,) * 2
    assert not _step(ex, sum(big), big) and not _step(ex, sum(big), big)
    assert not _step(ex, 512)  # a single u-batch of 512 is a shape of its own


def test_a_benchmark_warms_up_again_only_where_the_next_run_records_a_prompt_shape():
    """ferry bench's warm-up (tools/bench.measure): a prompt of one 512-token u-batch runs eagerly first and records
    on its second run, which must not be a timed one; shapes already recorded, decode steps and shapes past
    PROMPT_GRAPH_MAX leave nothing to record."""
    ex = _executor()
    _step(ex, 1)
    _step(ex, PROMPT_GRAPH_MAX + 1)
    assert not ex.will_record()
    _step(ex, 512)
    assert ex.will_record()
    _step(ex, 512)  # recorded
    assert not ex.will_record()
    eager = _executor(graphs=False)
    _step(eager, 512)
    assert not eager.will_record()


def test_nothing_is_recorded_without_graphs_or_where_the_backend_needs_the_host():
    for ex in (_executor(graphs=False), _executor(graph_safe=False)):
        assert not _step(ex, 1) and not _step(ex, 64) and not _step(ex, 64)


def test_a_new_prompt_shape_beyond_the_limit_drops_the_least_recently_replayed_one():
    ex = _executor()
    sizes = [DECODE_MAX + 1 + i for i in range(PROMPT_GRAPHS_KEPT)]
    for n in sizes:
        _step(ex, n)
        _step(ex, n)
    assert _step(ex, sizes[0])  # replayed: now the most recent
    newcomer = sizes[-1] + 1
    assert not _step(ex, newcomer) and _step(ex, newcomer)
    kept = sorted(k[2] for k in ex._captured)
    assert kept == sorted([sizes[0]] + sizes[2:] + [newcomer])  # sizes[1] was the least recent
    assert not _step(ex, sizes[1]) and _step(ex, sizes[1])  # it must run twice again to come back
    assert _step(ex, 1) and 1 in {k[2] for k in ex._captured}  # decode steps do not count against the limit
    batch = (DECODE_MAX,) * 2  # a layer-first batch does, even of decode-sized u-batches
    assert not _step(ex, 16, batch) and _step(ex, 16, batch)
    prompts = [k[2] for k in ex._captured if k[2] > 1]
    assert len(prompts) == PROMPT_GRAPHS_KEPT and sizes[3] not in prompts  # the least recent now


def test_the_timed_latent_forms_report_what_each_class_kept_and_why():
    """`ferry run --verbose` prints, per (tokens, cells) class, the form -mla 3 kept on the GPU and the times."""
    from ferry.runtime.runners.cuda import LatentForms

    forms = LatentForms()
    ex = forms.explorer
    for t in (9e-3, 2e-3, 2e-3, 2e-3):  # one layer each in turn: absorbed t, expanded t / 2
        for form, seconds in (("absorbed", t), ("expanded", t / 2 if t < 9e-3 else t)):
            assert ex.mode(512, {"absorbed": 1.0, "expanded": 1.0}, cells=5000) == (form, True)
            ex.record(512, form, seconds, cells=5000)
    ex.mode(64, {"absorbed": 1.0, "expanded": 1.0}, cells=64)
    ex.record(64, "absorbed", 1e-3, cells=64)
    assert forms.report() == [
        "-mla 3 prompt form expanded: measured for u-batches up to 512 over up to 8192 cells: absorbed 2.000 ms, "
        "expanded 1.000 ms",
        "-mla 3 prompt form for u-batches up to 64 over up to 64 cells: still being timed"]


def _words(capacity: int = 4) -> Handshakes:
    """The host's side of Handshakes over plain memory: what the GPU would write, a test writes."""
    hs = Handshakes.__new__(Handshakes)
    hs.host = np.zeros(2 * capacity, dtype=np.int32)
    return hs


def test_a_host_step_runs_once_its_graph_signals_it_then_lets_the_graph_go():
    hs = _words()
    ran = []

    def gpu() -> None:  # the graph reaches host step 1 a little later
        time.sleep(0.05)
        hs.host[2] = 1

    t = threading.Thread(target=gpu)
    t.start()
    hs.serve(1, lambda: ran.append((int(hs.host[2]), int(hs.host[3]))))
    t.join()
    assert ran == [(0, 0)]  # the ready word taken, the done word not yet written while the step runs
    assert hs.host.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


def test_a_host_step_its_graph_never_reaches_is_an_error(monkeypatch):
    monkeypatch.setattr(Handshakes, "TIMEOUT_S", 0.0)
    with pytest.raises(RuntimeError, match="did not reach host step 2"):
        _words().serve(2, lambda: None)


def test_a_failed_host_step_lets_its_graph_past_the_rest_of_its_waits():
    """The steps after it do not run; the graph is released at them (it would wait forever) and the error goes on."""
    served, released = [], []

    def serve(k, step):
        step()
        served.append(k)

    def fail():
        raise ValueError("ggml failed")

    rec = _Recorder(None, SimpleNamespace(serve=serve, release=released.extend))
    replay = rec._server([(0, lambda: None), (1, fail), (2, lambda: None)])
    with pytest.raises(ValueError, match="ggml failed"):
        replay()
    assert served == [0] and released == [1, 2]
