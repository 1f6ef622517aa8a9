"""ferry's tokenizer against llama.cpp's on llama.cpp's own vocabulary test files (models/ggml-vocab-*.gguf, the
texts of .inp and llama.cpp's token ids of .out, from the llama-cpp-python sdist the converter tests use), and, for
pre-tokenizers llama.cpp ships no test file for (DeepSeek-V3's, GLM-4.5's, Kimi K2's, gpt-oss's gpt-4o), on a
vocabulary given that pre-tokenizer's name against ids llama.cpp (ik_llama.cpp's llama-tokenize for gpt-4o) gave
(tests/fixtures/llamacpp_tokens/, written by benchmarks/llamacpp_tokens.py). A prompt tokenized otherwise than llama.cpp tokenizes it is another prompt."""

import json
from pathlib import Path

import pytest

from ferry.gguf.file import GGUFFile
from ferry.tokenizer import Tokenizer
from tests.fixtures.vocab import cases, with_pre

# every vocabulary there with texts, but BERT's (WordPiece: an embedding model's, which ferry does not run)
VOCABS = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm", "mpt",
          "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
LLAMACPP_TOKENS = Path(__file__).parent / "fixtures" / "llamacpp_tokens"


@pytest.fixture(scope="module")
def models(llamacpp_tree) -> Path:
    return llamacpp_tree / "models"


@pytest.mark.slow
@pytest.mark.parametrize("vocab", VOCABS)
def test_every_text_tokenizes_as_llama_cpp_tokenizes_it(vocab, models):
    path = models / f"ggml-vocab-{vocab}.gguf"
    tok = Tokenizer(GGUFFile(path))
    wrong = [(text, tok.encode(text, add_bos=False), ids) for text, ids in cases(path)
             if tok.encode(text, add_bos=False) != ids]
    assert not wrong, f"{len(wrong)} texts differ, e.g. {wrong[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["deepseek-v3", "glm4", "kimi-k2", "gpt-4o"])
def test_pre_tokenizers_without_a_test_file_cut_as_llama_cpp_cuts(pre, models, tmp_path):
    """Numbers, CJK, punctuation runs, whitespace and a special token written in the text."""
    ref = json.loads((LLAMACPP_TOKENS / f"{pre}.json").read_text(encoding="utf-8"))
    tok = Tokenizer(GGUFFile(with_pre(models / ref["vocab"], pre, tmp_path / "vocab.gguf")))
    wrong = [(text, tok.encode(text, add_bos=False), ids) for text, ids in zip(ref["texts"], ref["ids"])
             if tok.encode(text, add_bos=False) != ids]
    assert not wrong, f"{len(wrong)} texts differ, e.g. {wrong[0]}"


@pytest.mark.slow
def test_a_control_token_in_a_byte_level_vocabulary_keeps_its_own_id(models, tmp_path):
    """DeepSeek's <｜begin▁of▁sentence｜> is stored spelled as bytes; written in a prompt it is that one token."""
    tok = Tokenizer(GGUFFile(models / "ggml-vocab-deepseek-llm.gguf"))
    ids = tok.encode("<｜begin▁of▁sentence｜>Hi", add_bos=False)
    assert ids[0] == tok.tokens.index("<｜begin▁of▁sentence｜>") and len(ids) == 2
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜>Hi"


@pytest.mark.slow
def test_harmony_ends_generation_at_return_or_call_not_at_end(models, tmp_path):
    """gpt-oss's vocabulary: <|return|> and <|call|> end a generation; <|end|>, which ends the reasoning message
    before the final one, does not (llama.cpp's rule). Without those two, <|end|> ends it (Phi-3's)."""
    from tests.fixtures.vocab import with_tokens

    harmony = with_tokens(models / "ggml-vocab-qwen2.gguf",
                          {"<|im_start|>": "<|return|>", "<|im_end|>": "<|call|>", "<|endoftext|>": "<|end|>"},
                          tmp_path / "harmony.gguf")
    tok = Tokenizer(GGUFFile(with_pre(harmony, "gpt-4o", tmp_path / "harmony-gpt4o.gguf")))
    ends = {tok.tokens[i] for i in tok.eog_ids}
    assert ends == {"<|return|>", "<|call|>"}
    assert tok.encode("<|call|>", add_bos=False) == [tok.tokens.index("<|call|>")]
    only_end = Tokenizer(GGUFFile(with_tokens(models / "ggml-vocab-qwen2.gguf", {"<|endoftext|>": "<|end|>"},
                                              tmp_path / "end.gguf")))
    assert "<|end|>" in {only_end.tokens[i] for i in only_end.eog_ids}
