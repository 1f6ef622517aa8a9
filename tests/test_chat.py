"""`ferry chat` / `ferry run -cnv` and llama-cli's prompt habits: a conversation through the chat template whose turns
decode only what the KV cache does not hold; -f FILE, -e escapes, -sys."""

import subprocess
import sys

import pytest

from ferry.runtime.chat import Conversation, shared_prefix
from ferry.runtime.engine import Engine
from ferry.runtime.loader import RunConfig, load
from ferry.runtime.sampling import Sampler, SamplingParams
from ferry.tokenizer import Tokenizer, chat_template, render_chat


def ferry(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferry", *args], capture_output=True, text=True, timeout=600,
                          input=stdin)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load(RunConfig(tiny, n_threads=1, quiet=True))


def _conversation(loaded, system=None) -> Conversation:
    tok = Tokenizer(loaded.file)
    template, _ = chat_template(tok, loaded.model.args.arch)
    engine = Engine(loaded.model, loaded.backend, n_ctx=512)
    return Conversation(engine, tok, template, Sampler(SamplingParams(temp=0)), n_predict=6, system=system)


def test_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and shared_prefix([], [1]) == 0 and shared_prefix([7], [7]) == 1


def test_a_second_turn_decodes_only_what_the_cache_lacks_and_answers_as_a_fresh_engine_would(loaded, monkeypatch):
    chat = _conversation(loaded, system="Be terse.")
    decoded = []
    real = Engine.decode
    monkeypatch.setattr(Engine, "decode", lambda self, tokens, all_logits=False: decoded.append(len(tokens))
                        or real(self, tokens, all_logits))
    first = chat.turn("hello there", lambda piece: None)
    n_first = decoded[0]  # the first turn's prompt, decoded whole
    held = list(chat.cached)  # the first prompt and the answer's tokens but the last
    assert len(held) == n_first + 5  # n_predict 6: the last sampled token is never decoded
    decoded.clear()
    second = chat.turn("and again", lambda piece: None)
    whole = chat.tok.encode_chat(render_chat(chat.template, chat.messages[:-1], *chat.tok.special_texts()))
    shared = shared_prefix(held, whole)  # the answer's ids may re-encode otherwise; the first prompt is shared
    assert shared >= n_first and decoded[0] == len(whole) - shared and chat.turns == 2
    # the same conversation decoded whole by a fresh engine gives the same greedy answer
    monkeypatch.setattr(Engine, "decode", real)
    fresh = _conversation(loaded, system="Be terse.")
    fresh.messages += [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first}]
    assert fresh.turn("and again", lambda piece: None) == second


def test_a_turn_that_keeps_less_than_a_ring_holds_is_decoded_whole(tmp_path):
    """gpt-oss-tiny's window layers in 512-row rings (KVCache.ring): a first turn of some 700 tokens, then the
    conversation started over with another message, which shares only the template's first tokens with the cache,
    hundreds of positions behind what the rings hold: that turn is decoded from position 0 (before, truncate refused
    to go back there) and answers what a fresh conversation answers."""
    from ferry.cli import main

    path = tmp_path / "gpt-oss-tiny.gguf"
    assert main(["synth", "gpt-oss-tiny", "-o", str(path), "-q"]) == 0
    loaded = load(RunConfig(path, n_threads=1, quiet=True))
    tok = Tokenizer(loaded.file)
    template, _ = chat_template(tok, loaded.model.args.arch)

    def conversation():
        engine = Engine(loaded.model, loaded.backend, n_ctx=2048, n_ubatch=96)
        return Conversation(engine, tok, template, Sampler(SamplingParams(temp=0)), n_predict=4)

    chat = conversation()
    chat.turn(" ".join(f"item {i}" for i in range(100)), lambda piece: None)
    assert chat.engine.kv.ring == 512 and chat.engine.n_past > 600
    chat.messages = []  # started over: only the template's opening is shared
    before = chat.decoded
    answer = chat.turn("a different question", lambda piece: None)
    prompt = tok.encode_chat(render_chat(template, chat.messages[:1], *tok.special_texts()))
    assert chat.decoded - before == len(prompt)  # decoded whole, from position 0
    assert answer == conversation().turn("a different question", lambda piece: None)


def test_chat_reads_turns_from_stdin_and_run_cnv_is_the_same(tiny):
    a = ferry("chat", "-m", str(tiny), "--temp", "0", "-n", "4", "-t", "1", stdin="hello\nhow are you\n")
    b = ferry("run", "-cnv", "-m", str(tiny), "--temp", "0", "-n", "4", "-t", "1", stdin="hello\nhow are you\n")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.count("\n") >= 2
    assert "2 turns" in a.stderr and "chatml" in a.stderr  # qwen3moe files without a template: ChatML


def test_run_takes_its_prompt_from_a_file_with_escapes_and_a_system_prompt(tiny, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Once upon a time\n")
    r = ferry("run", "-m", str(tiny), "-f", str(path), "-n", "0", "-q")
    assert r.returncode == 0 and r.stdout == "Once upon a time\n", r.stdout  # the file's last newline dropped
    r = ferry("run", "-m", str(tiny), "a\\tb\\nc", "-n", "0", "-q")
    assert r.stdout == "a\tb\nc\n", r.stdout
    r = ferry("run", "-m", str(tiny), "a\\tb", "--no-escape", "-n", "0", "-q")
    assert r.stdout == "a\\tb\n", r.stdout
    r = ferry("run", "-m", str(tiny), "-sys", "Be terse.", "Hi", "-n", "3", "--temp", "0")
    assert r.returncode == 0 and "the prompt goes through the built-in 'chatml' template" in r.stderr
    assert not r.stdout.startswith(("Hi", "<|im_start|>"))  # the answer alone, as a chat prints it
    r = ferry("run", "-m", str(tiny), "Hi", "-f", str(path))
    assert r.returncode == 2 and "give the prompt once" in r.stderr


@pytest.mark.slow
def test_the_embedded_gemma_chats_in_gemmas_format_not_chatml():
    """Its file holds no chat template: Gemma's built-in one, not ChatML (the file is Gemma 3 270M's base model, so
    what it answers is not checked)."""
    r = ferry("run", "-sys", "Answer in one word.", "What is the capital of France?", "-n", "3", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "the prompt goes through the built-in 'gemma' template (gemma3 files without one of their own)" in r.stderr
    assert "<|im_start|>" not in r.stdout
