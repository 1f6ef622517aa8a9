"""llama.cpp's token ids (llama-cpp-python, vocabulary only) for texts, on a vocabulary file given a pre-tokenizer
name, as JSON: the reference of tests/test_tokenizer_vocabs.py for pre-tokenizers llama.cpp ships no test file for
(DeepSeek-V3's, GLM-4.5's). Runs in its own process (llama-cpp-python's libggml and ggml-python's clash).
  python benchmarks/llamacpp_tokens.py VOCAB.gguf PRE TEXTS.inp OUT.json
VOCAB: one of llama.cpp's models/ggml-vocab-*.gguf; TEXTS: texts separated as in its .inp files."""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.vocab import SEPARATOR, with_pre  # noqa: E402


def main() -> None:
    vocab, pre, texts_file, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    from llama_cpp import Llama

    texts = texts_file.read_text(encoding="utf-8").split(SEPARATOR)
    with tempfile.TemporaryDirectory() as tmp:
        llm = Llama(str(with_pre(vocab, pre, Path(tmp) / "vocab.gguf")), vocab_only=True, verbose=False)
        ids = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    json.dump({"vocab": vocab.name, "pre": pre, "texts": texts, "ids": ids}, open(out, "w"), ensure_ascii=False,
              indent=0)


if __name__ == "__main__":
    main()
