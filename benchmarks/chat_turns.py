"""A 10-turn conversation on `ferry serve`: each turn's time to first token (streamed /v1/chat/completions, greedy),
with the prompt cache and without it (cache_prompt false), and what the server reports it prefilled (timings.prompt_n)
and reused (cache_n). Against issue 36's targets: a turn prefills only its new tokens, and its time to first token
is within 1.2x of what those tokens alone cost (the same count of the prompt's last tokens sent alone, cache off).
With --llama-server PATH the same conversation runs on llama.cpp's llama-server too, on the same file with the same
slots, context and threads, after ferry's server has stopped: each engine keeps its own answers in its history (as a
user's client would), so the prompts differ by the answers' tokens; the table gives each turn's TTFT on both and
their ratio. Prints a table, writes JSON.
  python benchmarks/chat_turns.py [-m MODEL] [--turns 10] [-t 2] [--answer 32] [--llama-server PATH]
(no -m: the embedded Gemma 3 270M)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import httpx

try:
    from benchmarks.serve_prefill import free_port, serve
except ImportError:  # run as a script from the repository root
    from serve_prefill import free_port, serve

TOPICS = ["rivers", "old towns", "the sea", "mountains", "rain", "bridges", "markets", "forests", "ships", "winter",
          "roads", "gardens"]


def turn(client: httpx.Client, messages: list[dict], answer: int, cache: bool) -> dict:
    """One streamed chat request: its time to the first content, its text and the server's timings."""
    body = {"messages": messages, "max_tokens": answer, "temperature": 0, "stream": True, "cache_prompt": cache}
    t0, first, text, last = time.perf_counter(), None, [], {}
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta and first is None:
                first = time.perf_counter() - t0
            text.append(delta or "")
            last = chunk
    return {"ttft_s": first if first is not None else time.perf_counter() - t0, "text": "".join(text),
            "timings": last.get("timings", {}), "prompt_tokens": last.get("usage", {}).get("prompt_tokens")}


def alone(client: httpx.Client, tokens: list[int]) -> float:
    """Seconds to the first token of a prompt of these tokens alone, cache off."""
    t0 = time.perf_counter()
    client.post("/completion", json={"prompt": tokens, "n_predict": 1, "temperature": 0, "cache_prompt": False},
                timeout=600).raise_for_status()
    return time.perf_counter() - t0


def conversation(url: str, turns: int, answer: int) -> list[dict]:
    """The conversation on the server at `url`: per turn, with the cache and without it, and the new tokens alone.
    One client throughout, a connection a request (llama-server closes a streamed one): a client made per request
    costs 30-50 ms of its own setup, which a time to first token should not count; a connection costs about 3."""
    rows = []
    messages: list[dict] = []
    client = httpx.Client(base_url=url, limits=httpx.Limits(max_keepalive_connections=0))
    for i in range(turns):
        topic = TOPICS[i % len(TOPICS)]
        messages.append({"role": "user", "content": f"Turn {i + 1}. Tell me something about {topic}, and how "
                         f"{topic} changed over the centuries, in a few short sentences, with one example."})
        cached = turn(client, messages, answer, True)
        fresh = turn(client, messages, answer, False)
        prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
        ids = client.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
        n_new = cached["timings"].get("prompt_n", 0)
        cache_n = cached["timings"].get("cache_n")
        rows.append({"turn": i + 1, "prompt_tokens": cached["prompt_tokens"] or (n_new + (cache_n or 0)),
                     "cache_n": cache_n, "prompt_n": n_new, "ttft_cached_s": cached["ttft_s"],
                     "ttft_fresh_s": fresh["ttft_s"], "ttft_new_alone_s": alone(client, ids[-n_new:]) if n_new else None,
                     "same_answer": cached["text"] == fresh["text"]})
        messages.append({"role": "assistant", "content": cached["text"]})
    client.close()
    return rows


def llama_server(path: str, model: str, threads: str):
    """llama.cpp's llama-server on `model` with ferry's flags here (one slot, -c 16384, its prompt cache on by
    default), on a free port: (its URL, the process) once /health answers 200."""
    port = free_port()
    proc = subprocess.Popen([path, "-m", model, "-np", "1", "-c", "16384", "-t", threads, "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"chat_turns: {path} exited with {proc.returncode} before serving")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"chat_turns: {path} did not answer /health in 120 s")


def table(rows: list[dict], title: str) -> None:
    print(f"\n{title}\n")
    print("| turn | prompt tokens | cache_n | prompt_n | TTFT cached s | TTFT no cache s | new tokens alone s | "
          "cached / alone | same answer |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        ratio = r["ttft_cached_s"] / r["ttft_new_alone_s"] if r["ttft_new_alone_s"] else float("nan")
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['cache_n']} | {r['prompt_n']} | {r['ttft_cached_s']:.2f} | "
              f"{r['ttft_fresh_s']:.2f} | {r['ttft_new_alone_s'] or 0:.2f} | {ratio:.2f} | {r['same_answer']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("-t", "--threads", default="2")
    ap.add_argument("--answer", type=int, default=32, help="tokens an answer may take")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server: the same conversation on it, after ferry's")
    ap.add_argument("--json", default="chat_turns.json")
    a = ap.parse_args()
    url, srv, thread = serve((["-m", a.model] if a.model else []) + ["-np", "1", "-c", "16384", "-t", a.threads])
    try:
        rows = conversation(url, a.turns, a.answer)
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    table(rows, "ferry serve")
    out = {"ferry": rows}
    if a.llama_server:
        from ferry.runtime.loader import default_model

        url, proc = llama_server(a.llama_server, a.model or str(default_model()), a.threads)
        try:
            out["llama-server"] = conversation(url, a.turns, a.answer)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        table(out["llama-server"], "llama-server")
        print("\n| turn | ferry TTFT cached s | llama-server TTFT cached s | llama-server / ferry | ferry TTFT no cache s "
              "| llama-server TTFT no cache s | llama-server / ferry |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for f, l in zip(rows, out["llama-server"]):
            print(f"| {f['turn']} | {f['ttft_cached_s']:.3f} | {l['ttft_cached_s']:.3f} | "
                  f"{l['ttft_cached_s'] / f['ttft_cached_s']:.2f} | {f['ttft_fresh_s']:.3f} | {l['ttft_fresh_s']:.3f} | "
                  f"{l['ttft_fresh_s'] / f['ttft_fresh_s']:.2f} |")
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
