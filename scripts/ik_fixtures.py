"""Rebuild the ik_llama.cpp oracle and regenerate the fixtures tests/test_ik_types.py checks ferry against: ik's own
llama-quantize (built from ../shared/anchors' tarball, CPU only, into ~/.cache/ferry-anchors/ik) quantizes a
`ferry synth qwen3-moe-tiny` F16 file to each of ik's types below, then quantizes that back to F32 (ik's own
dequantization); for one tensor per type (its smallest of that type), its bytes and ik's float32 values go to
tests/fixtures/ik/TYPE.npz.
  python scripts/ik_fixtures.py [--tarball PATH] [--types Q6_0,IQ4_KS]
The build takes about 10 minutes on 2 cores the first time; CI only reads the fixtures."""

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferry.gguf.file import GGUFFile  # noqa: E402
from ferry.quant import dequantize  # noqa: E402



def build(tarball: Path, where: Path) -> Path:
    """ik_llama.cpp's llama-quantize, built once (CPU only)."""
    exe = where / "build" / "bin" / "llama-quantize"
    if exe.exists():
        return exe
    if not (where / "CMakeLists.txt").exists():
        where.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tf:
            for m in tf.getmembers():
                parts = Path(m.name).parts[1:]
                if parts:
                    m.name = str(Path(*parts))
                    tf.extract(m, where, filter="data")
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF"], cwd=where, check=True)
    subprocess.run(["cmake", "--build", "build", "-j2", "--target", "llama-quantize"], cwd=where, check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tarball", default=str(ROOT.parent / "shared" / "anchors" / "ik_llama.cpp-8337e4c.tar.gz"))
    ap.add_argument("--types", default="Q6_0,IQ4_KS")
    a = ap.parse_args()
    quantize = build(Path(a.tarball), Path.home() / ".cache" / "ferry-anchors" / "ik")
    out = ROOT / "tests" / "fixtures" / "ik"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "f16.gguf"
        subprocess.run([sys.executable, "-m", "ferry", "synth", "qwen3-moe-tiny", "--type", "f16", "--expert-type",
                        "f16", "-o", str(f16), "-q"], check=True, cwd=ROOT)
        for name in a.types.split(","):
            quantized, back = Path(tmp) / f"{name}.gguf", Path(tmp) / f"{name}-f32.gguf"
            subprocess.run([str(quantize), str(f16), str(quantized), name, "1"], check=True, capture_output=True)
            subprocess.run([str(quantize), "--allow-requantize", str(quantized), str(back), "F32", "1"], check=True,
                           capture_output=True)
            f = GGUFFile(quantized, ik=True)
            tensor = min(f.ik_tensors(), key=lambda n: np.prod(f.ik_tensor(n)[1]))
            raw_type, ne, data = f.ik_tensor(tensor)
            g = GGUFFile(back)
            t = g.tensor(tensor)
            theirs = dequantize(g.data(t), t.qtype, t.ne)
            np.savez_compressed(out / f"{name}.npz", raw=np.array(data), raw_type=raw_type, ne=np.array(ne),
                                ik_values=theirs.astype(np.float32))
            print(f"{name}: {tensor} {list(ne)}, {data.nbytes} bytes -> {out / (name + '.npz')}")


if __name__ == "__main__":
    main()
