"""A 10-turn conversation on `ferry serve`: each turn's time to first token (streamed /v1/chat/completions, greedy),
with the prompt cache and without it (cache_prompt false), and what the server reports it prefilled (timings.prompt_n)
and reused (cache_n). Against issue 36's targets: a turn prefills only its new tokens, and its time to first token
is within 1.2x of what those tokens alone cost (the same count of the prompt's last tokens sent alone, cache off).
Prints a table, writes JSON.
  python benchmarks/chat_turns.py [-m MODEL] [--turns 10] [-t 2] [--answer 32]
(no -m: the embedded Gemma 3 270M)
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

try:
    from benchmarks.serve_prefill import serve
except ImportError:  # run as a script from the repository root
    from serve_prefill import serve

TOPICS = ["rivers", "old towns", "the sea", "mountains", "rain", "bridges", "markets", "forests", "ships", "winter",
          "roads", "gardens"]


def turn(url: str, messages: list[dict], answer: int, cache: bool) -> dict:
    """One streamed chat request: its time to the first content, its text and the server's timings."""
    body = {"messages": messages, "max_tokens": answer, "temperature": 0, "stream": True, "cache_prompt": cache}
    t0, first, text, last = time.perf_counter(), None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
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


def alone(url: str, tokens: list[int]) -> float:
    """Seconds to the first token of a prompt of these tokens alone, cache off."""
    t0 = time.perf_counter()
    httpx.post(url + "/completion", json={"prompt": tokens, "n_predict": 1, "temperature": 0, "cache_prompt": False},
               timeout=600).raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("-t", "--threads", default="2")
    ap.add_argument("--answer", type=int, default=32, help="tokens an answer may take")
    ap.add_argument("--json", default="chat_turns.json")
    a = ap.parse_args()
    url, srv, thread = serve((["-m", a.model] if a.model else []) + ["-np", "1", "-c", "16384", "-t", a.threads])
    rows = []
    try:
        messages: list[dict] = []
        for i in range(a.turns):
            topic = TOPICS[i % len(TOPICS)]
            messages.append({"role": "user", "content": f"Turn {i + 1}. Tell me something about {topic}, and how "
                             f"{topic} changed over the centuries, in a few short sentences, with one example."})
            cached = turn(url, messages, a.answer, True)
            fresh = turn(url, messages, a.answer, False)
            prompt = httpx.post(url + "/apply-template", json={"messages": messages}).json()["prompt"]
            ids = httpx.post(url + "/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
            n_new = cached["timings"].get("prompt_n", 0)
            rows.append({"turn": i + 1, "prompt_tokens": cached["prompt_tokens"], "cache_n": cached["timings"].get(
                "cache_n"), "prompt_n": n_new, "ttft_cached_s": cached["ttft_s"], "ttft_fresh_s": fresh["ttft_s"],
                "ttft_new_alone_s": alone(url, ids[-n_new:]) if n_new else None,
                "same_answer": cached["text"] == fresh["text"]})
            messages.append({"role": "assistant", "content": cached["text"]})
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    print("| turn | prompt tokens | cache_n | prompt_n | TTFT cached s | TTFT no cache s | new tokens alone s | "
          "cached / alone | same answer |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        ratio = r["ttft_cached_s"] / r["ttft_new_alone_s"] if r["ttft_new_alone_s"] else float("nan")
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['cache_n']} | {r['prompt_n']} | {r['ttft_cached_s']:.2f} | "
              f"{r['ttft_fresh_s']:.2f} | {r['ttft_new_alone_s'] or 0:.2f} | {ratio:.2f} | {r['same_answer']} |")
    with open(a.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
