"""Tokenizer from GGUF metadata, built by transformers' GGUF converter into a `tokenizers` Tokenizer; chat templates
(the file's own, --chat-template, or its family's built-in one) rendered as Hugging Face renders them.

It is rebuilt per process (Gemma's 262k vocabulary takes about 3 s here); BOS and end-of-generation
rules follow llama.cpp.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile

# token texts that end a turn in chat models; llama.cpp treats them as end-of-generation too
EOG_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<|eom_id|>", "<|return|>",
             "<|call|>", "[e~[")  # [e~[: MiniMax-M2's end of a turn
# gpt-oss's harmony format ends a message with <|end|> and the model's turn with <|return|> or <|call|>: with those two
# in the vocabulary <|end|> ends no generation, as in llama.cpp (the final answer follows the reasoning's <|end|>)
HARMONY_ENDS = ("<|return|>", "<|call|>")
_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}


# Byte-level BPE vocabularies whose pre-tokenizer (tokenizer.ggml.pre) transformers' converter does not know: the
# regular expressions that cut text into pieces before merging, applied one after another (each cuts the pieces of
# the one before, matches and the text between them both kept), as the models' own tokenizer.json files and
# llama.cpp (llama-vocab.cpp) cut them. Without them the text is cut as GPT-2 cuts it: "12345" one piece instead
# of "123" "45", and other tokens than llama.cpp's for the same prompt.
# (code points written as escapes: an editor's Unicode normalization would turn some, e.g. U+1F7D, into others)
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
PRE_SPLITS = {
    "deepseek-llm": [r"[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                     r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_HANGUL,
                     r"\p{N}+"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"],
    "deepseek-v3": [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "glm4": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_SPLITS["chatglm-bpe"] = PRE_SPLITS["glm5"] = PRE_SPLITS["glm4"]
for _pre in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"):
    PRE_SPLITS[_pre] = [r"\p{N}", _GPT2]  # each digit apart, then GPT-2's pieces
_NOT_HAN_UPPER, _NOT_HAN_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_ANY_CASE_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PRE_SPLITS["kimi-k2"] = [  # Kimi K2's own (tiktoken) rule: runs of Han characters apart from other letters
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?" + _NOT_HAN_UPPER + "*" + _NOT_HAN_LOWER + "+" + _ANY_CASE_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?" + _NOT_HAN_UPPER + "+" + _NOT_HAN_LOWER + "*" + _ANY_CASE_CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
PRE_SPLITS["falcon"] = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"]
PRE_SPLITS["gpt-4o"] = [  # o200k's (gpt-oss's tokenizer.json; llama.cpp spells its letter classes otherwise, same ids)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _ANY_CASE_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _ANY_CASE_CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
PRE_SPLITS["minimax-m2"] = PRE_SPLITS["gpt-4o"]  # llama.cpp cuts MiniMax-M2's text as o200k's
# vocabularies whose pieces found whole in the vocabulary are taken whole, merges or not (llama.cpp: ignore_merges)
IGNORE_MERGES = {"glm4", "glm5", "llama3", "llama-v3", "llama-bpe"}


def _cut_as(tok, pre: str) -> None:
    """Give a byte-level BPE tokenizer `pre`'s pre-tokenizer (PRE_SPLITS)."""
    from tokenizers import Regex, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _converter():
    """transformers' GGUF-metadata-to-tokenizer converter: integrations.ggml in 4.x, integrations.gguf in the
    5.x releases that keep it (5.17, on the GPU machine's image, replaced it by a file-path API)."""
    import transformers

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        try:
            from transformers.integrations.ggml import convert_gguf_tokenizer
        except ImportError:
            raise FerryError(f"transformers {transformers.__version__} has no convert_gguf_tokenizer, which ferry "
                             "builds tokenizers with; install transformers 5.23 (pip install transformers==5.23.*)") from None
    return convert_gguf_tokenizer


class Tokenizer:
    def __init__(self, f: GGUFFile):
        convert_gguf_tokenizer = _converter()  # one line where transformers (and so tokenizers) is missing
        from tokenizers import AddedToken, pre_tokenizers

        meta = {v: f.get(f"tokenizer.ggml.{k}") for k, v in _KEYS.items() if f.get(f"tokenizer.ggml.{k}") is not None}
        if "tokens" not in meta or "tokenizer_type" not in meta:
            raise FerryError(f"{f.path}: no tokenizer in the metadata (tokenizer.ggml.tokens/model); re-convert the model with its tokenizer")
        for k in ("scores", "token_type"):
            if isinstance(meta.get(k), np.ndarray):
                meta[k] = meta[k].tolist()
        self.tokens: list[str] = meta["tokens"]
        try:
            self._tok, _ = convert_gguf_tokenizer(f.architecture, meta)
        except (ValueError, KeyError) as e:
            # older transformers (5.17 on the GPU machine) look their converters up by architecture
            if isinstance(e, KeyError) and e.args and e.args[0] == f.architecture:
                import transformers

                raise FerryError(f"{f.path}: transformers {transformers.__version__} builds no tokenizer for "
                                 f"'{f.architecture}' files; install the version ferry is tested with "
                                 "(pip install transformers==5.23.*)") from None
            raise FerryError(f"{f.path}: cannot build its tokenizer ({e}); this tokenizer type is not supported yet") from None
        types = meta.get("token_type") or []
        kinds = {3: True, 4: False}  # llama.cpp's control (special) and user-defined tokens: matched in the text whole
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        whole = [i for i, k in enumerate(types) if k in kinds and self.tokens[i] not in added]
        self._tok.add_tokens([AddedToken(self.tokens[i], special=kinds[types[i]], normalized=False) for i in whole])
        # a byte-level vocabulary holds such a token's text spelled as bytes, so the tokenizer gave its text a new id
        self._own_id = {new: i for i in whole if (new := self._tok.token_to_id(self.tokens[i])) != i}
        pre = meta.get("pre_tokenizer_type")
        if meta["tokenizer_type"] == "gpt2" and pre in PRE_SPLITS:
            _cut_as(self._tok, pre)
        if meta["tokenizer_type"] == "gpt2" and pre in IGNORE_MERGES:
            self._tok.model.ignore_merges = True
        self.n_vocab = len(self.tokens)
        self.bos_id = f.get("tokenizer.ggml.bos_token_id")
        self.eos_id = f.get("tokenizer.ggml.eos_token_id")
        spm = meta["tokenizer_type"] == "llama"
        self._special = None  # SPM text gets llama.cpp's space prefix (_spaced) when not None
        if spm and f.get("tokenizer.ggml.add_space_prefix", True) and isinstance(self._tok.pre_tokenizer,
                                                                                 pre_tokenizers.Metaspace):
            # the Metaspace prepends its space only to the first piece, and not where the text starts with one:
            # " Hello" became "▁Hello", where llama.cpp's "▁▁Hello" is two tokens
            self._tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
            specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values()), key=len, reverse=True)
            self._special = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else re.compile("(?!)")
        self.add_bos = bool(f.get("tokenizer.ggml.add_bos_token", spm)) and self.bos_id is not None
        eog = {self.eos_id, f.get("tokenizer.ggml.eot_token_id"), f.get("tokenizer.ggml.eom_token_id")}
        ids = {t: self._own_id.get(i, i) for t, i in self._tok.get_vocab().items()}  # the file's ids
        eog |= {ids[t] for t in EOG_TEXTS if t in ids}
        if all(t in ids for t in HARMONY_ENDS) and "<|end|>" in ids:
            eog.discard(ids["<|end|>"])
        self.eog_ids = {i for i in eog if i is not None and i < len(self.tokens)}  # ids the model can give
        self.chat_template: str | None = f.get("tokenizer.chat_template")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids; special tokens written in the text are kept whole (llama.cpp's parse_special)."""
        if self._special is not None:
            text = self._spaced(text)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._own_id:
            ids = [self._own_id.get(i, i) for i in ids]
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def _spaced(self, text: str) -> str:
        """llama.cpp's SentencePiece rule: a space before the text and before every stretch of text that follows a
        special token (split() leaves the text at even places, each after the start or a special token)."""
        parts = self._special.split(text)
        return "".join(" " + p if i % 2 == 0 and p else p for i, p in enumerate(parts))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def special_texts(self) -> tuple[str, str]:
        """The texts of BOS and EOS ("" where the vocabulary has none), as chat templates take them."""
        return tuple(self.decode([i]) if i is not None else "" for i in (self.bos_id, self.eos_id))

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat's tokens: BOS added where the model adds one and the template did not write it."""
        bos, _ = self.special_texts()
        return self.encode(text, add_bos=self.add_bos and not (bos and text.startswith(bos)))


class StreamDecoder:
    """Decodes a growing list of tokens into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.printed = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.printed):]
        self.printed = text
        return piece


class TemplateError(FerryError):
    """A chat template that fails on, or refuses, the messages given (the server answers 400)."""


# Chat templates by name (--chat-template NAME), each the format its family's models were trained on, written as
# Jinja as a model's own template would be; a file without a template gets its family's (FAMILY_TEMPLATES).
BUILTIN_TEMPLATES = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gemma": ("{{ bos_token }}{% set first = messages[0].content + '\n\n' if messages[0].role == 'system' else '' %}"
              "{% for m in messages if m.role != 'system' %}"
              "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
              "{{ (first if loop.first else '') + m.content | trim }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
               "{{ m.content | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "llama2": ("{% set sys = '<<SYS>>\n' + messages[0].content + '\n<</SYS>>\n\n' if messages[0].role == 'system' "
               "else '' %}{% for m in messages if m.role != 'system' %}{% if m.role == 'user' %}{{ bos_token }}[INST] "
               "{{ (sys if loop.first else '') + m.content | trim }} [/INST]{% else %} {{ m.content | trim }} "
               "{{ eos_token }}{% endif %}{% endfor %}"),
    "deepseek3": ("{{ bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}"
                  "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
                  "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"),
    # DeepSeek-V4's without thinking: each assistant turn opens with the end of an empty think block
    "deepseek4": ("{{ bos_token }}{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}"
                  "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
                  "{% elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content }}<｜end▁of▁sentence｜>"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"),
    "glm4": ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}
FAMILY_TEMPLATES = {"gemma3": "gemma", "llama": "llama3", "qwen2": "chatml", "qwen3": "chatml", "qwen3moe": "chatml",
                    "qwen35": "chatml", "qwen35moe": "chatml", "qwen3next": "chatml", "deepseek2": "deepseek3", "glm4moe": "glm4",
                    "deepseek32": "deepseek3", "glm-dsa": "glm4", "deepseek4": "deepseek4"}


def chat_template(tok: Tokenizer, arch: str, flag: str | None = None) -> tuple[str, str]:
    """(the Jinja source a chat is rendered with, where it comes from): --chat-template NAME (a built-in), FILE or the
    template itself where given; else the file's own; else its family's built-in one, else ChatML."""
    if flag:
        if flag in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[flag], f"the built-in '{flag}' template (--chat-template)"
        path = Path(flag)
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8"), f"the template in {path} (--chat-template)"
            except (OSError, UnicodeDecodeError) as e:
                raise FerryError(f"--chat-template {flag}: cannot read it ({e})") from None
        if "{{" in flag or "{%" in flag:
            return flag, "the template given with --chat-template"
        raise FerryError(f"--chat-template '{flag}' is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                         "nor a file; give one of those names or a Jinja file")
    if tok.chat_template:
        return tok.chat_template, "the model's own template"
    name = FAMILY_TEMPLATES.get(arch, "chatml")
    return BUILTIN_TEMPLATES[name], f"the built-in '{name}' template ({arch} files without one of their own)"


def render_chat(template: str, messages: list[dict], bos: str, eos: str, add_generation_prompt: bool = True) -> str:
    """The chat template (jinja2, sandboxed, as Hugging Face's templates expect to run) rendered with the messages;
    TemplateError where it fails on them or refuses them."""
    from jinja2 import TemplateError as JinjaError

    try:
        return _template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token=bos, eos_token=eos)
    except JinjaError as e:
        raise TemplateError(f"the chat template failed on these messages: {e}") from None


@functools.lru_cache(maxsize=8)
def _template(source: str):
    """A chat template compiled as Hugging Face's templates expect to be run (and llama.cpp runs them): blocks
    trimmed, loop controls (break / continue), raise_exception, strftime_now, a tojson that writes plain JSON
    (jinja2's own escapes <, >, & and ' for HTML), and `{% generation %}` blocks (marks of the assistant's text
    for training masks) rendered as their content."""
    import datetime

    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

        def _content(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(f"the chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception as e:  # a template jinja2 cannot parse
        raise TemplateError(f"the chat template does not parse: {e}") from None
