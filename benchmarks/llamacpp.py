"""llama.cpp from a PyPI sdist, for side-by-side benchmarks: find the llama.cpp tree inside an sdist
(llama-cpp-python's carries one under vendor/llama.cpp), build llama-bench and llama-perplexity from it,
and build ggml-python's native library from that tree's ggml, so that both engines run the same kernels.

  python benchmarks/llamacpp.py fetch DIR                 # pip download llama-cpp-python's sdist (network)
  python benchmarks/llamacpp.py strip SDIST OUT.tar.gz    # the tree without docs/models/tests (to carry)
  python benchmarks/llamacpp.py build SRC [--cuda]        # prints the llama-bench path
  python benchmarks/llamacpp.py ggml-python GGML_PY_SDIST SRC   # pip install ggml-python on SRC's ggml
  python benchmarks/llamacpp.py converter [SRC]           # the tree with convert_hf_to_gguf.py (fetched if no SRC)
SRC is an sdist (.tar.gz) or a folder holding the tree.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("FERRY_CACHE", Path.home() / ".cache" / "ferry")) / "llama.cpp"
# what a build of llama-bench and llama-perplexity does not read
_UNUSED = {"docs", "models", "media", "build", ".git", ".github", "tests", "examples", "pocs", "app", "benches",
           "gguf-py", "conversion", "scripts", "ci", ".devops", "skills"}
_TARGETS = ["llama-bench", "llama-perplexity"]
# /proc/cpuinfo flag -> ggml's CMake option. AMX is left out: it segfaulted in llama.cpp on the dev Xeon
_ISA = {"avx": "AVX", "avx2": "AVX2", "avx512f": "AVX512", "avx512_bf16": "AVX512_BF16", "avx512vbmi": "AVX512_VBMI",
        "avx512_vnni": "AVX512_VNNI", "avx_vnni": "AVX_VNNI", "bmi2": "BMI2", "f16c": "F16C", "fma": "FMA",
        "sse4_2": "SSE42"}


def cpu_flags() -> list[str]:
    """This CPU's vector extensions as explicit ggml flags (GGML_NATIVE=OFF), the same for both engines.
    Why not -march=native: ggml-python built native ran the repacked Q4_0 GEMV (MoE decode) at 34.5 t/s on
    the dev Xeon against 44.7 t/s with these flags (docs/decisions.md)."""
    try:
        words = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{opt}={'ON' if flag in words else 'OFF'}" for flag, opt in _ISA.items()]


def _is_tree(d: Path) -> bool:
    return (d / "ggml" / "CMakeLists.txt").is_file() and (d / "tools" / "llama-bench").is_dir()


def _unpack(archive: Path) -> Path:
    key = hashlib.sha256(f"{archive.resolve()}:{archive.stat().st_size}:{archive.stat().st_mtime}".encode()).hexdigest()[:12]
    out = CACHE / f"src-{key}"
    if not out.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=CACHE))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="tar")
        try:
            tmp.rename(out)  # whole or not at all
        except OSError:  # another process unpacked it first
            if not out.is_dir():
                raise
            shutil.rmtree(tmp)
    return out


def source_tree(src: Path) -> Path:
    """The llama.cpp tree in an sdist or folder (the folder itself, or vendor/llama.cpp or one level down)."""
    root = _unpack(src) if src.is_file() else src
    for d in [root, *sorted(root.glob("*")), *sorted(root.glob("*/vendor/llama.cpp")), *sorted(root.glob("vendor/llama.cpp"))]:
        if d.is_dir() and _is_tree(d):
            return d
    sys.exit(f"llamacpp: no llama.cpp tree (ggml/ and tools/llama-bench/) in {src}")


def fetch(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", SDIST, "--no-binary", ":all:", "--no-deps", "-d", str(dest)],
                   check=True)
    return next(dest.glob("llama_cpp_python-*.tar.gz"))


def converter(src: Path | None = None) -> Path:
    """The llama.cpp tree whose HF -> GGUF converter (convert_hf_to_gguf.py beside conversion/ and gguf-py/),
    vocabulary test files and chat templates the tests use: SRC, else $FERRY_LLAMA_CPP_SDIST (an sdist or a folder),
    else SDIST fetched into the cache once. A stripped tree (`strip`) has no converter."""
    if src is None and os.environ.get("FERRY_LLAMA_CPP_SDIST"):
        src = Path(os.environ["FERRY_LLAMA_CPP_SDIST"])
    if src is None:
        sdists = sorted((CACHE / "sdist").glob("llama_cpp_python-*.tar.gz"))
        src = sdists[-1] if sdists else fetch(CACHE / "sdist")
    tree = source_tree(src)
    if not (tree / "convert_hf_to_gguf.py").is_file() or not (tree / "gguf-py").is_dir():
        sys.exit(f"llamacpp: {src} holds no converter (convert_hf_to_gguf.py and gguf-py/); give an unstripped sdist")
    return tree


def strip(src: Path, out: Path) -> None:
    tree = source_tree(src)
    with tarfile.open(out, "w:gz") as tar:
        for p in sorted(tree.iterdir()):
            if p.name not in _UNUSED:
                tar.add(p, arcname=f"llama.cpp/{p.name}")


def build(src: Path, cuda: bool = False, cmake_args: list[str] | None = None) -> Path:
    """Build llama-bench and llama-perplexity (once per tree and flags); returns llama-bench's path."""
    tree = source_tree(src)
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
            f"-DGGML_CUDA={'ON' if cuda else 'OFF'}", *(cmake_args or cpu_flags())]
    key = hashlib.sha256(f"{tree.resolve()}:{args}".encode()).hexdigest()[:12]
    build_dir = CACHE / f"build-{key}"
    exe = build_dir / "bin" / "llama-bench"
    if not exe.is_file():
        subprocess.run(["cmake", "-S", str(tree), "-B", str(build_dir), *args], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target", *_TARGETS],
                       check=True, stdout=subprocess.DEVNULL)
    return exe


def wait_for_build(path_file: str) -> str | None:
    """The llama-bench path a background build writes into `path_file` (scripts/gpu_check.sh), once it is there;
    None if the build failed."""
    src = Path(path_file)
    while not (src.is_file() and src.read_text().strip()):
        time.sleep(2)
    exe = src.read_text().strip()
    if exe == "failed":
        print("llama.cpp's build failed: its log says why", file=sys.stderr)
        return None
    return exe


def llama_bench_rows(cmd: list[str]) -> dict[str, dict]:
    """Run llama-bench with `-o json`: per row, keyed by (n_prompt, n_gen, n_ubatch), its mean, std and samples."""
    r = subprocess.run([*cmd, "-o", "json"], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"llama-bench failed ({r.returncode}): {' '.join(cmd)}\n" + "\n".join(r.stderr.splitlines()[-15:]))
    rows = json.loads(r.stdout)
    return {(r["n_prompt"], r["n_gen"], r["n_ubatch"]): {"avg_ts": r["avg_ts"], "stddev_ts": r["stddev_ts"],
                                                         "samples_ts": r["samples_ts"]} for r in rows}


def build_ggml_python(ggml_python_src: Path, src: Path) -> None:
    """pip install ggml-python with its vendored ggml replaced by the tree's (llamafile sgemm on, the flags
    of cpu_flags() unless CMAKE_ARGS is set)."""
    tree = source_tree(src)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ggml-python"
        if ggml_python_src.is_file():
            with tarfile.open(ggml_python_src) as tar:
                tar.extractall(tmp, filter="tar")
            (Path(tmp) / next(p for p in os.listdir(tmp) if p.startswith("ggml_python"))).rename(root)
        else:
            shutil.copytree(ggml_python_src, root)
        shutil.rmtree(root / "vendor" / "ggml")
        shutil.copytree(tree / "ggml", root / "vendor" / "ggml")
        flags = os.environ.get("CMAKE_ARGS") or " ".join(cpu_flags())
        env = {**os.environ, "CMAKE_ARGS": f"-DGGML_LLAMAFILE=ON {flags}"}
        isolation = [] if importlib.util.find_spec("scikit_build_core") is None else ["--no-build-isolation"]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", *isolation,
                        str(root)], check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch").add_argument("dest", type=Path)
    p = sub.add_parser("strip")
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("build")
    p.add_argument("src", type=Path)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--cmake-arg", action="append", help="replaces the default: this CPU's flags (cpu_flags())")
    sub.add_parser("converter").add_argument("src", type=Path, nargs="?")
    p = sub.add_parser("ggml-python")
    p.add_argument("ggml_python_src", type=Path)
    p.add_argument("src", type=Path)
    a = ap.parse_args()
    if a.cmd == "fetch":
        print(fetch(a.dest))
    elif a.cmd == "strip":
        strip(a.src, a.out)
    elif a.cmd == "converter":
        print(converter(a.src))
    elif a.cmd == "build":
        print(build(a.src, a.cuda, a.cmake_arg))
    else:
        build_ggml_python(a.ggml_python_src, a.src)


if __name__ == "__main__":
    main()
