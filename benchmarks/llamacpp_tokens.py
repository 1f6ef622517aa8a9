"""llama.cpp's token ids (llama-cpp-python, vocabulary only) for texts, on a vocabulary file given a pre-tokenizer
name, as JSON: the reference of tests/test_tokenizer_vocabs.py for pre-tokenizers llama.cpp ships no test file for
(DeepSeek-V3's, GLM-4.5's). Runs in its own process (llama-cpp-python's libggml and ggml-python's clash).
  python benchmarks/llamacpp_tokens.py VOCAB.gguf PRE TEXTS.inp OUT.json [LLAMA_TOKENIZE]
VOCAB: one of llama.cpp's models/ggml-vocab-*.gguf; TEXTS: texts separated as in its .inp files; LLAMA_TOKENIZE: a
llama-tokenize binary (llama.cpp's or ik_llama.cpp's) to ask instead of llama-cpp-python (gpt-4o.json: ik_llama.cpp's
8337e4c, whose ids for Kimi K2's texts are llama-cpp-python's, all 54)."""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.vocab import SEPARATOR, with_pre  # noqa: E402


def main() -> None:
    vocab, pre, texts_file, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    texts = texts_file.read_text(encoding="utf-8").split(SEPARATOR)
    with tempfile.TemporaryDirectory() as tmp:
        model = with_pre(vocab, pre, Path(tmp) / "vocab.gguf")
        if len(sys.argv) > 5:
            ids = [_tokenize(sys.argv[5], model, t, Path(tmp) / "text") for t in texts]
        else:
            from llama_cpp import Llama

            llm = Llama(str(model), vocab_only=True, verbose=False)
            ids = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    json.dump({"vocab": vocab.name, "pre": pre, "texts": texts, "ids": ids}, open(out, "w"), ensure_ascii=False,
              indent=0)


def _tokenize(binary: str, model: Path, text: str, scratch: Path) -> list[int]:
    """llama-tokenize's ids for text (special tokens parsed, no BOS), the text passed as a file's bytes."""
    import ast
    import subprocess

    scratch.write_bytes(text.encode())
    run = subprocess.run([binary, "-m", str(model), "-f", str(scratch), "--ids", "--no-bos", "--log-disable"],
                         capture_output=True, text=True, check=True)
    return ast.literal_eval([line for line in run.stdout.splitlines() if line.startswith("[")][-1])


if __name__ == "__main__":
    main()
