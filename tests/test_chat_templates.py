"""Chat templates (ferry/tokenizer.py): the models' own against transformers' rendering (the reference for Hugging
Face templates) on the real templates llama.cpp keeps for its tests (models/templates/*.jinja of the llama-cpp-python
sdist: DeepSeek V3.1-V4, Kimi K2/K3, GLM-4.6/4.7, Qwen3, gpt-oss, Llama 3.x, Mistral, ...), the same prompt text
character for character; the built-in templates and which one a file without its own gets."""

from pathlib import Path

import pytest

from ferry.errors import FerryError
from ferry.tokenizer import BUILTIN_TEMPLATES, TemplateError, chat_template, render_chat

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
                except TemplateError:
                    pass
                continue
            try:
                got = render_chat(source, messages, "<BOS>", "<EOS>")
            except TemplateError as e:
                got = f"refused: {e}"
            if got == want:
                same += 1
            else:
                wrong.append((path.name, got[:200], want[:200]))
    assert not wrong, f"{len(wrong)} renderings differ, e.g. {wrong[0]}"
    assert same >= 100


def test_a_template_renders_with_a_generation_prompt_and_refuses_in_one_error():
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat(template, msgs, "<bos>", "<eos>") == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(TemplateError, match="no tools"):
        render_chat(template, [{"role": "tool", "content": "x"}], "<bos>", "<eos>")
    with pytest.raises(TemplateError, match="does not parse"):
        render_chat("{% for m in messages %}", msgs, "", "")


def _tok(template=None):
    from types import SimpleNamespace

    return SimpleNamespace(chat_template=template)


def test_the_files_own_template_comes_first_then_its_familys_then_chatml():
    own, where = chat_template(_tok("{{ messages[0].content }}"), "gemma3")
    assert own == "{{ messages[0].content }}" and where == "the model's own template"
    gemma, where = chat_template(_tok(), "gemma3")
    assert gemma == BUILTIN_TEMPLATES["gemma"] and "'gemma'" in where and "gemma3" in where
    assert chat_template(_tok(), "qwen3moe")[0] == BUILTIN_TEMPLATES["chatml"]
    assert chat_template(_tok(), "an-arch-nobody-knows")[0] == BUILTIN_TEMPLATES["chatml"]
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert render_chat(gemma, msgs, "<bos>", "") == ("<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n"
                                                    "<start_of_turn>model\n")


def test_chat_template_flag_takes_a_name_a_file_or_the_template_itself(tmp_path):
    assert chat_template(_tok("{{ 'own' }}"), "llama", "chatml")[0] == BUILTIN_TEMPLATES["chatml"]
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'from a file' }}")
    assert chat_template(_tok(), "llama", str(path))[0] == "{{ 'from a file' }}"
    assert chat_template(_tok(), "llama", "{{ 'inline' }}")[0] == "{{ 'inline' }}"
    with pytest.raises(FerryError, match="neither a built-in template .*chatml, gemma"):
        chat_template(_tok(), "llama", "gemma4")


@pytest.mark.slow
def test_the_builtin_gemma_template_renders_as_gemmas_own(templates):
    """Without a system turn (which Gemma 2's own template refuses), the built-in 'gemma' renders exactly what Gemma's
    template in llama.cpp's test set renders through transformers."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = next(p for p in templates if p.name == "google-gemma-2-2b-it.jinja").read_text()
    for messages in ([{"role": "user", "content": "Hi <b>there</b>"}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": " 2+2? "}], CONVERSATIONS[1]):
        want = render_jinja_template(conversations=[messages], chat_template=source, add_generation_prompt=True,
                                     bos_token="<BOS>", eos_token="<EOS>")[0][0]
        assert render_chat(BUILTIN_TEMPLATES["gemma"], messages, "<BOS>", "<EOS>") == want


@pytest.mark.slow
def test_the_builtin_deepseek4_template_renders_as_deepseek_v4s_own(templates):
    """A file without its template gets the built-in 'deepseek4': what DeepSeek-V4's own template (llama.cpp's test
    set) renders through transformers with thinking off, system turn included."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = next(p for p in templates if p.name == "deepseek-ai-DeepSeek-V4.jinja").read_text()
    for messages in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": " 2+2? "}],
                     [{"role": "user", "content": "one turn"}]):
        want = render_jinja_template(conversations=[messages], chat_template=source, add_generation_prompt=True,
                                     bos_token="<BOS>", eos_token="<EOS>")[0][0]
        assert render_chat(BUILTIN_TEMPLATES["deepseek4"], messages, "<BOS>", "<EOS>") == want
