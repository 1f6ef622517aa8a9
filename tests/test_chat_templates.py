"""`ferry serve`'s chat templates against transformers' rendering (the reference for Hugging Face templates) on the
real templates llama.cpp keeps for its tests (models/templates/*.jinja of the llama-cpp-python sdist: DeepSeek
V3.1-V4, Kimi K2/K3, GLM-4.6/4.7, Qwen3, gpt-oss, Llama 3.x, Mistral, ...): the same prompt text, character for
character. Before session 11, 15 of 65 failed or differed: no break/continue, strftime_now, {% generation %}."""

from pathlib import Path

import pytest

from ferry.server.app import BadRequest, render_chat

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi <b>there</b> & 'you'"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": 'Ünïcode 中文 "quotes"\nnew line'}],
]


@pytest.fixture(scope="module")
def templates(llamacpp_tree) -> list[Path]:
    found = sorted((llamacpp_tree / "models" / "templates").glob("*.jinja"))
    assert len(found) > 40
    return found


@pytest.mark.slow
def test_every_template_renders_as_transformers_renders_it(templates):
    from transformers.utils.chat_template_utils import render_jinja_template

    same, wrong = 0, []
    for path in templates:
        source = path.read_text(encoding="utf-8")
        for messages in CONVERSATIONS:
            try:
                want = render_jinja_template(conversations=[messages], chat_template=source,
                                             add_generation_prompt=True, bos_token="<BOS>", eos_token="<EOS>")[0][0]
            except Exception:  # a template that refuses these messages (no system role, tools required, ...):
                try:               # ferry may render it (it passes no tools=None) or refuse it in one line
                    render_chat(source, messages, "<BOS>", "<EOS>")
                except BadRequest:
                    pass
                continue
            try:
                got = render_chat(source, messages, "<BOS>", "<EOS>")
            except BadRequest as e:
                got = f"refused: {e.message}"
            if got == want:
                same += 1
            else:
                wrong.append((path.name, got[:200], want[:200]))
    assert not wrong, f"{len(wrong)} renderings differ, e.g. {wrong[0]}"
    assert same >= 100
