"""Tokenizer from GGUF metadata, built by transformers' GGUF converter into a `tokenizers` Tokenizer.

It is rebuilt per process (Gemma's 262k vocabulary takes about 3 s here); BOS and end-of-generation
rules follow llama.cpp.
"""

from __future__ import annotations

import numpy as np

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile

# token texts that end a turn in chat models; llama.cpp treats them as end-of-generation too
EOG_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<|eom_id|>")
_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}


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
        convert_gguf_tokenizer = _converter()
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
            raise FerryError(f"{f.path}: cannot build its tokenizer ({e}); this tokenizer type is not supported yet") from None
        self.n_vocab = len(self.tokens)
        self.bos_id = f.get("tokenizer.ggml.bos_token_id")
        self.eos_id = f.get("tokenizer.ggml.eos_token_id")
        spm = meta["tokenizer_type"] == "llama"
        self.add_bos = bool(f.get("tokenizer.ggml.add_bos_token", spm)) and self.bos_id is not None
        eog = {self.eos_id, f.get("tokenizer.ggml.eot_token_id"), f.get("tokenizer.ggml.eom_token_id")}
        ids = self._tok.get_vocab()
        eog |= {ids[t] for t in EOG_TEXTS if t in ids}
        self.eog_ids = {i for i in eog if i is not None}
        self.chat_template: str | None = f.get("tokenizer.chat_template")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids; special tokens written in the text are kept whole (llama.cpp's parse_special)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids


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
