"""A chat answer's reasoning apart from its content (ferry/server/reasoning.py), the way llama-server's
--reasoning-format auto splits it: <think> tags and gpt-oss's harmony channels, whole and cut into pieces anywhere
(a stream's tokens); and the server's chat endpoint giving reasoning_content, streamed and not, on a scheduler that
answers a known text."""

import json

import pytest
from fastapi.testclient import TestClient

from ferry.server.app import create_app
from ferry.server.reasoning import Splitter, kind_of

HARMONY = ("<|start|>{{ m }}<|channel|>analysis<|message|>...<|end|>"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
THINK = "{% for m in messages %}<|im_start|>{{ m.content }}<think></think>{% endfor %}<|im_start|>assistant\n"

CASES = [
    ("think", "", "<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", "First, 2 + 2.\n", "It is 4."),
    ("think", "<|im_start|>assistant\n<think>\n", "Opened by the prompt.</think>The answer.", "Opened by the prompt.",
     "The answer."),
    ("think", "", "No reasoning at all.", "", "No reasoning at all."),
    ("think", "", "<thinking> is not the tag", "", "<thinking> is not the tag"),
    ("think", "", "An answer that mentions <think> later.", "", "An answer that mentions <think> later."),
    ("think", "", "<think>cut off before the end", "cut off before the end", ""),
    ("harmony", "<|start|>assistant", "<|channel|>analysis<|message|>User wants a greeting.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Hello there!", "User wants a greeting.", "Hello there!"),
    ("harmony", "", "<|channel|>analysis<|message|>a < b <| not a marker<|end|><|start|>assistant<|channel|>final "
     "<|message|>x<|return|>", "a < b <| not a marker", "x"),
    ("harmony", "", "Plain text without a header.", "", "Plain text without a header."),
    ("harmony", "", "<|channel|>analysis<|message|>stopped mid-thought", "stopped mid-thought", ""),
    ("harmony", "", "<|channel|>commentary<|message|>A preamble.<|end|>", "", "A preamble."),
    ("harmony", "", "<|channel|><|message|>no channel name", "", "no channel name"),
]


def _split(kind, prompt, pieces):
    s = Splitter(kind, prompt)
    parts = [s.push(p) for p in pieces] + [s.finish()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


@pytest.mark.parametrize("kind,prompt,text,reasoning,content", CASES)
def test_reasoning_and_content_come_apart_wherever_the_stream_cuts(kind, prompt, text, reasoning, content):
    assert _split(kind, prompt, [text]) == (reasoning, content)
    assert _split(kind, prompt, list(text)) == (reasoning, content)  # a character a token
    for cut in range(1, len(text)):
        assert _split(kind, prompt, [text[:cut], text[cut:]]) == (reasoning, content), cut


def test_the_template_tells_the_format():
    assert kind_of(HARMONY) == "harmony"
    assert kind_of(THINK) == "think"
    assert kind_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None


class _Tokenizer:
    chat_template = None

    def special_texts(self):
        return "", ""

    def encode_chat(self, text):
        return [1] * 4


class _Scheduler:
    """Answers every request with the text given, in pieces, then done."""
    seq_len, slots = 64, [None]

    def __init__(self, pieces):
        self.pieces = pieces

    def submit(self, r):
        for p in self.pieces:
            r.out.put_nowait(("text", (p, [])))
        r.out.put_nowait(("done", {"finish_reason": "stop", "usage": {}, "timings": {}}))


@pytest.mark.parametrize("template,pieces,reasoning,content", [
    (HARMONY, ["<|channel|>analysis<|message|>", "Think", "ing.<|e", "nd|><|start|>assistant<|channel|>final",
               "<|message|>Hi", "!"], "Thinking.", "Hi!"),
    (THINK, ["<think>", "\nhm", "m</th", "ink>\n\n", "Sure."], "hmm", "Sure."),
])
def test_the_chat_endpoint_gives_reasoning_content_streamed_and_whole(template, pieces, reasoning, content):
    app = create_app(_Scheduler(pieces), _Tokenizer(), "m", template=template)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as client:
        msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (msg.get("reasoning_content"), msg["content"]) == (reasoning, content)
        events = client.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
        deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events if e.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
        assert "".join(d.get("content") or "" for d in deltas) == content
        assert not any(d.get("content") and d.get("reasoning_content") for d in deltas)
        raw = client.post("/v1/chat/completions", json={**body, "reasoning_format": "none"}).json()
        assert raw["choices"][0]["message"] == {"role": "assistant", "content": "".join(pieces)}
        bad = client.post("/v1/chat/completions", json={**body, "reasoning_format": "maybe"})
        assert bad.status_code == 400 and "reasoning_format" in bad.json()["error"]["message"]


def test_a_template_without_reasoning_leaves_the_answer_whole():
    pieces = ["<think>", "x</think>y"]
    app = create_app(_Scheduler(pieces), _Tokenizer(), "m", template="{{ messages[0].content }}")
    with TestClient(app) as client:
        msg = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert msg["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}

