"""`ferry serve` under load on loopback: N clients for a fixed time, each sending requests of mixed prompt lengths
(llama-server's /completion, streamed or not, greedy) and hanging up on some mid-stream. Every answer that completes
must give the tokens that prompt gets alone (computed first, one request at a time), up to a near tie: where the two
first differ, the token under load was among the answer alone's five likeliest, within TIE of its log probability
(ggml multiplies batches of other shapes by other paths: the tiny synthetic model's KV rows and logits moved by up to
0.007 between a prompt prefilled whole and in small chunks beside another slot; Gemma 3 amplifies rounding, and on
these word-salad prompts its likeliest tokens lie close: a prompt repeated from the cache, only its last token
prefilled again alone, moved its top log probabilities by 0.07 and its first token to one 0.14 below the top,
docs/performance.md).
Nothing lost, nothing corrupted. Reports requests completed, hung up, wrong and failed, tokens per second, and the server process's
resident memory after a warm-up round and at the end. Prints a table, writes JSON.
  python benchmarks/serve_load.py [-m MODEL] [--clients 32] [--seconds 60] [-np 4] [-t 2] [--rss-every 30]
(no -m: the embedded Gemma 3 270M)
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import httpx

try:
    from benchmarks.serve_prefill import serve
except ImportError:  # run as a script from the repository root
    from serve_prefill import serve


def rss_mib(trim: bool = False) -> float:
    """This process's resident memory (the server runs in it), MiB. trim: first collect garbage and hand the C heap's
    free pages back to the system (glibc's malloc_trim), so that what is left is what is live, not what the
    allocator kept of the test process's earlier work."""
    if trim:
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024


def prompts_of(n: int, seed: int) -> list[str]:
    """n prompts of mixed lengths: a few words to a few hundred."""
    rng = random.Random(seed)
    words = "the cat sat on a mat while rain fell over old towns and rivers ran to seas".split()
    return [f"prompt {i}: " + " ".join(rng.choice(words) for _ in range(rng.choice([3, 20, 80, 250]))) for i in range(n)]


TIE = 0.25  # log probability: two tokens this close are a near tie under another batch shape


def load(url: str, clients: int, seconds: float, max_tokens: int = 8, n_prompts: int = 24, seed: int = 0,
         rss_every: float = 0.0, trim: bool = False) -> dict:
    """The run described above against a server at url; returns its counts and memory (rss_every > 0: the resident
    memory sampled that often too, as (seconds, MiB) pairs: whether it levels off; trim: the start and end figures
    after rss_mib's trim)."""
    prompts = prompts_of(n_prompts, seed)

    def ask(prompt: str, n_probs: int = 0) -> dict:
        r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                                                  "return_tokens": True, "n_probs": n_probs}, timeout=600)
        r.raise_for_status()
        return r.json()

    alone = {p: ask(p, n_probs=5) for p in prompts}

    def same(p: str, tokens: list[int]) -> bool:
        """tokens are prompt p's alone, up to a near tie where they first differ."""
        want = alone[p]["tokens"]
        if tokens == want:
            return True
        j = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        if j is None or j >= len(want):  # one a prefix of the other: an end of generation moved
            return False
        top = alone[p]["completion_probabilities"][j]["top_logprobs"]
        return any(t["id"] == tokens[j] and top[0]["logprob"] - t["logprob"] < TIE for t in top[1:])
    for p in prompts[:4]:
        ask(p)  # a warm-up round under no load: graphs built, caches grown
    rss_start = rss_mib(trim)
    counts = {"completed": 0, "hung_up": 0, "wrong": 0, "ties": 0, "failed": 0, "tokens": 0}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.perf_counter() < deadline:
            p = rng.choice(prompts)
            mode = rng.random()
            try:
                if mode < 0.2:  # hang up after the first event
                    with httpx.stream("POST", url + "/completion", json={"prompt": p, "n_predict": 200,
                                                                         "stream": True}, timeout=600) as r:
                        next(r.iter_lines())
                    kind, tokens = "hung_up", None
                elif mode < 0.6:  # streamed to the end
                    tokens = []
                    with httpx.stream("POST", url + "/completion", json={
                            "prompt": p, "n_predict": max_tokens, "temperature": 0, "stream": True}, timeout=600) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                tokens += json.loads(line[6:])["tokens"]
                    kind = "completed"
                else:
                    kind, tokens = "completed", ask(p)["tokens"]
            except Exception as e:  # a refused or broken request: counted, never retried
                with lock:
                    counts["failed"] += 1
                    errors.append(repr(e)[:200])
                continue
            with lock:
                if kind == "completed" and not same(p, tokens):
                    counts["wrong"] += 1
                    errors.append(f"{p[:30]!r}: {tokens} != {alone[p]['tokens']}")
                else:
                    counts[kind] += 1
                    counts["ties"] += kind == "completed" and tokens != alone[p]["tokens"]
                    counts["tokens"] += len(tokens) if kind == "completed" else 0

    t0 = time.perf_counter()
    samples: list[tuple[float, float]] = []

    def sample() -> None:
        while time.perf_counter() < deadline:
            samples.append((round(time.perf_counter() - t0, 1), round(rss_mib(), 1)))
            time.sleep(rss_every)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    if rss_every > 0:
        threads.append(threading.Thread(target=sample))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for _ in range(200):  # hung-up requests free their slots at the next step
        if httpx.get(url + "/health").json()["slots_processing"] == 0:
            break
        time.sleep(0.05)
    return {**counts, "errors": errors[:10], "seconds": elapsed, "tokens_per_s": counts["tokens"] / elapsed,
            "slots_processing_after": httpx.get(url + "/health").json()["slots_processing"],
            "rss_mib_start": rss_start, "rss_mib_end": rss_mib(trim), "rss_mib_samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("-np", "--parallel", default="4")
    ap.add_argument("-t", "--threads", default="2")
    ap.add_argument("--json", default="serve_load.json")
    ap.add_argument("--rss-every", type=float, default=0.0, help="seconds between samples of resident memory (0: none)")
    ap.add_argument("--cache-ram", help="the server's RAM prompt cache, MiB (default: the server's)")
    a = ap.parse_args()
    flags = ((["-m", a.model] if a.model else []) + ["-np", a.parallel, "-c", "8192", "-t", a.threads]
             + (["--cache-ram", a.cache_ram] if a.cache_ram else []))
    url, srv, thread = serve(flags)
    try:
        r = load(url, a.clients, a.seconds, rss_every=a.rss_every)
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    print("| clients | seconds | completed (at a near tie) | hung up | wrong | failed | tokens/s | RSS MiB start -> end |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print(f"| {a.clients} | {r['seconds']:.0f} | {r['completed']} ({r['ties']}) | {r['hung_up']} | {r['wrong']} | "
          f"{r['failed']} | "
          f"{r['tokens_per_s']:.1f} | {r['rss_mib_start']:.0f} -> {r['rss_mib_end']:.0f} |")
    if r["rss_mib_samples"]:
        print("RSS MiB over the run (seconds: MiB): " + ", ".join(f"{t:g}: {m:.0f}" for t, m in r["rss_mib_samples"]))
    for e in r["errors"]:
        print("error:", e)
    with open(a.json, "w") as fh:
        json.dump(r, fh, indent=1)


if __name__ == "__main__":
    main()
