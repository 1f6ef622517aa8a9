"""What a long prompt arriving costs the streams already running on `ferry serve`, per u-batch size: the server
mixes a chunk of a new prompt into each decode step (chunked prefill): by default as many tokens as keep the running
streams at 70% of their speed, with -b that many (a -b past what one forward holds beside the streams: whole u-batches
apart, before the step), so a larger chunk prefills the prompt sooner and slows the running streams more.

Per -ub and -b, one server in this process (-np 2): stream A generates (greedy) while prompt B (about --prompt-tokens
tokens) arrives; measured: B's time to its first token, A's longest gap between two tokens while B prefills, and A's
median gap, and A's tokens per second while B prefills over before. Prints a table, writes JSON.
  python benchmarks/serve_prefill.py [-m MODEL] [--ub 64,256,512,4096] [--b 0,2048] [-t 2] [--prompt-tokens 2000]
      [--alone]
(no -m: the embedded Gemma 3 270M)
"""

import argparse
import json
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from ferry.cli import build_parser, build_server


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(flags: list[str]):
    """`ferry serve FLAGS` in this process (uvicorn in a thread, any free port): (its URL, the uvicorn server, the
    thread); set the server's should_exit and join the thread to stop it. tests/test_server.py starts its servers so."""
    app = build_server(build_parser().parse_args(["serve", *flags]))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", srv, thread


def ram_conversation(path, slots: str, cache_ram: str, other: bool, flags: list[str], threads: str = "1") -> dict:
    """Turn 1 of conversation A on `ferry serve -m path` with `slots` slots, then (other) B's unrelated prompt, then
    A's turn 2: its answer. The RAM prompt cache's scenario of tests/test_server.py and tests_gpu/test_server_gpu.py."""
    a = "conversation A begins with a question about ram caches"
    url, srv, thread = serve(["-m", str(path), "-np", slots, "-c", "1024", "-t", threads, "--cache-ram", cache_ram,
                              *flags])
    try:
        def ask(prompt):
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 6},
                           timeout=120)
            r.raise_for_status()
            return r.json()
        first = ask(a)
        if other:
            ask("zebras: conversation B is about something else entirely")
        return ask(a + first["choices"][0]["text"] + " next")
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def one(url: str, prompt_tokens: int, n_stream: int, alone: bool = False) -> dict:
    """alone: stream A runs once by itself first, so that its speed while B prefills compares with its own over the
    same tokens (the same context lengths), not only with its first tokens'."""
    arrivals: list[float] = []

    def stream_a(times: list[float]) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": n_stream, "temperature": 0, "stream": True,
                "cache_prompt": False, "ignore_eos": True}  # A runs to its limit: through all of B's prefill
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())

    solo: list[float] = []
    if alone:
        stream_a(solo)
    a = threading.Thread(target=stream_a, args=(arrivals,))
    a.start()
    while len(arrivals) < 20:
        time.sleep(0.01)
    words = " ".join(["the cat sat on the mat and"] * (prompt_tokens // 7))  # a word a token, in most vocabularies
    t0 = time.perf_counter()
    b = httpx.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 1, "temperature": 0,
                                                  "cache_prompt": False}, timeout=3600).json()
    t1 = time.perf_counter()
    a.join()
    if "usage" not in b:
        raise SystemExit(f"serve_prefill: prompt B failed: {b}")
    gaps = [(y - x) * 1e3 for x, y in zip(arrivals, arrivals[1:])]
    during = [(y - x) * 1e3 for x, y in zip(arrivals, arrivals[1:]) if y > t0 and x < t1]
    before = [t for t in arrivals if t < t0]
    rate_before = (len(before) - 1) / (before[-1] - before[0])
    inside = [t for t in arrivals if t0 <= t <= t1]
    rate_during = len(inside) / (min(t1, arrivals[-1]) - t0) if inside else 0.0
    kept_alone = None
    if alone and inside:  # A's tokens i0..i1 arrived while B prefilled: the same tokens' time alone
        i0, i1 = arrivals.index(inside[0]), arrivals.index(inside[-1])
        if i1 > i0 and i1 < len(solo):
            kept_alone = (solo[i1] - solo[i0]) / (arrivals[i1] - arrivals[i0])
    return {"b_prompt_tokens": b["usage"]["prompt_tokens"], "b_first_token_s": t1 - t0,
            "a_speed_kept_during_b": rate_during / rate_before, "a_speed_kept_vs_alone": kept_alone,
            "a_max_gap_ms_during_b": max(during) if during else None, "a_median_gap_ms": statistics.median(gaps),
            "a_tokens_during_b": len(during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--ub", default="64,256,512,4096", help="u-batch sizes, comma list")
    ap.add_argument("--b", default="0", help="serve's -b per -ub (0: one u-batch a step), comma list")
    ap.add_argument("-t", "--threads", default="2")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--alone", action="store_true",
                    help="stream A once by itself first: its speed while B prefills against its own over the same tokens")
    ap.add_argument("--json", default="serve_prefill.json")
    a = ap.parse_args()
    rows = []
    print("| -ub | -b | B's prompt tokens | B's first token s | A's longest gap during B, ms | A's tokens during B | "
          "A's median gap, ms | A's speed during B / before | the same / A alone over those tokens |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ub, b in ((int(u), int(b)) for u in a.ub.split(",") for b in a.b.split(",")):
        ctx = 2 * max(4096, a.prompt_tokens + a.stream_tokens + 512)  # two slots: each holds B's prompt or A's stream
        flags = (["-m", a.model] if a.model else []) + ["-np", "2", "-c", str(ctx), "-t", a.threads, "-ub", str(ub),
                                                        "-b", str(b)]
        url, srv, thread = serve(flags)
        try:
            row = {"ub": ub, "b": b, **one(url, a.prompt_tokens, a.stream_tokens, a.alone)}
        finally:
            srv.should_exit = True
            thread.join(timeout=30)
        rows.append(row)
        gap, vs = row["a_max_gap_ms_during_b"], row["a_speed_kept_vs_alone"]
        vs = f"{vs:.2f}" if vs is not None else "-"
        print(f"| {ub} | {b} | {row['b_prompt_tokens']} | {row['b_first_token_s']:.2f} | "
              f"{gap:.0f} | {row['a_tokens_during_b']} | {row['a_median_gap_ms']:.1f} | "
              f"{row['a_speed_kept_during_b']:.2f} | {vs} |" if gap is not None else
              f"| {ub} | {b} | {row['b_prompt_tokens']} | {row['b_first_token_s']:.2f} | - | 0 | "
              f"{row['a_median_gap_ms']:.1f} | 0 | {vs} |",
              flush=True)
    with open(a.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
