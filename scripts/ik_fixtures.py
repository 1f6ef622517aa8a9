"""Rebuild the ik_llama.cpp oracle and regenerate the fixtures tests/test_ik_types.py checks ferry against: ik's own
llama-quantize (built from ../shared/anchors' tarball, CPU only, into ~/.cache/ferry-anchors/ik) quantizes a
`ferry synth qwen3-moe-tiny` F16 file to each of ik's types below, then quantizes that back to F32 (ik's own
dequantization); for one tensor per type (the first 64 rows of its smallest of that type), its bytes and ik's float32
values go to tests/fixtures/ik/TYPE.npz.
It also writes whole models as ik_llama.cpp users have them: a one-layer `qwen3-moe-tiny` quantized by ik with its
routed experts in IQ4_KS beside an IQ5_KS down (or IQ4_K) and every other type ferry reads in some other tensor, and one with IQ2_KS
experts beside an IQ3_KS down, and one interleaved as ik's --repack writes IQ4_KS (MODELS; tests/fixtures/ik/qwen3moe-ik*.gguf, 1.5-2.6 MB each), a text, and ik's
llama-perplexity on each, on its weights as F32 (ik's dequantization) and on the F16 file it came from
(qwen3moe-ik*.json).
  python scripts/ik_fixtures.py [--tarball PATH] [--types Q6_0,IQ4_KS,...] [--models qwen3moe-ik,...]
The build takes about 10 minutes on 2 cores the first time; CI only reads the fixtures."""

import argparse
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferry.gguf.file import GGUFFile  # noqa: E402
from ferry.quant import IK_TYPES, dequantize, ik_type_bytes  # noqa: E402



def build(tarball: Path, where: Path) -> Path:
    """ik_llama.cpp's llama-quantize and llama-perplexity, built once (CPU only)."""
    exe = where / "build" / "bin" / "llama-quantize"
    if exe.exists() and exe.with_name("llama-perplexity").exists():
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
    subprocess.run(["cmake", "--build", "build", "-j2", "--target", "llama-quantize", "llama-perplexity"], cwd=where,
                   check=True)
    return exe


# the whole models: a one-layer tiny MoE with its routed experts in one type and every other type ferry reads in
# some other tensor
MODELS = {"qwen3moe-ik": ("IQ4_KS", "attn_q=iq5_ks,attn_k=iq3_ks,attn_v=iq2_ks,attn_output=iq2_kl,output=iq4_kss,"
                                    "token_embd=q6_0,ffn_down_exps=iq5_ks"),
          "qwen3moe-ik-k": ("IQ4_K", "attn_q=iq5_k,attn_k=iq3_k,attn_v=iq2_k,attn_output=iq6_k,output=iq4_k,"
                                     "token_embd=iq5_k"),
          "qwen3moe-ik-low": ("IQ2_KS", "ffn_down_exps=iq3_ks,output=q6_0,token_embd=q6_0"),
          "qwen3moe-ik-r4": ("IQ4_KS_R4", "output=q6_0,token_embd=q6_0"),
          "qwen3moe-ik-kl": ("IQ2_KL", "ffn_down_exps=iq4_kss,output=q6_0,token_embd=q6_0"),
          "qwen3moe-ik-k2": ("IQ2_K", "ffn_down_exps=iq3_k,output=q6_0,token_embd=q6_0"),
          "qwen3moe-ik-k2-r4": ("IQ2_K_R4", "ffn_down_exps=iq3_k_r4,attn_q=iq5_ks_r4,attn_output=iq5_k_r4,"
                                            "output=q6_0,token_embd=q6_0"),
          "qwen3moe-ik-kt": ("IQ2_KT", "ffn_down_exps=iq3_kt,attn_q=iq4_kt,attn_k=iq1_kt,output=q6_0,token_embd=q6_0"),
          "qwen3moe-ik-iq2": ("IQ2_XXS_R4", "ffn_down_exps=iq2_xs_r4,attn_q=iq2_s_r4,attn_k=iq2_s_r4,output=q6_0,"
                                            "token_embd=q6_0"),
          "qwen3moe-ik-r8": ("Q4_K_R4", "ffn_down_exps=q6_k_r4,attn_q=q8_0_r8,attn_k=q5_k_r4,attn_v=iq4_xs_r8,"
                                       "attn_output=q4_0_r8,output=q6_0,token_embd=q6_0")}
TYPES = ("Q6_0,IQ4_KS,IQ5_KS,IQ4_KSS,IQ3_KS,IQ2_KS,IQ2_KL,IQ2_K,IQ3_K,IQ4_K,IQ5_K,IQ6_K,IQ4_KS_R4,IQ4_K_R4,IQ5_KS_R4,"
         "IQ2_K_R4,IQ3_K_R4,IQ5_K_R4,IQ1_KT,IQ2_KT,IQ3_KT,IQ4_KT,Q8_0_R8,Q4_K_R4,Q6_K_R4,Q5_K_R4,IQ4_XS_R8,Q4_0_R8,"
         "Q6_0_R4,IQ4_NL_R4,MXFP4_R8,BF16_R16,Q5_0_R4,Q3_K_R4,Q2_K_R4,IQ3_XXS_R4,IQ3_S_R4,IQ2_XXS_R4,IQ2_XS_R4,"
         "IQ2_S_R4")
# ik's F32 conversion fails for these (MXFP4_R8's dequantizer runs past its rows, BF16_R16 has none): their values come
# from ik's plain MXFP4 quantization of the same rows (the same blocks) and from the F16 rows truncated to bf16 (what
# ik's BF16_R16 quantizer does; ik's matmul on such a file gives exactly these)
NO_F32 = {"MXFP4_R8": "MXFP4", "BF16_R16": "truncated"}
# ik's llama-quantize refuses its lowest-bit types without an importance matrix unless told to go on
NO_IMATRIX = ["--ignore-imatrix-rules"]
# types its llama-quantize has no file type for: written by --custom-q into the attention and routed experts of a file
# of another type
CUSTOM = {"IQ2_S_R4": "IQ2_XXS_R4"}
ROWS = 64
PPL_ARGS = ["-c", "128", "--chunks", "8", "-t", "2"]


def ik_ppl(perplexity: Path, model: Path, text: Path) -> list[float]:
    """ik's llama-perplexity: the running estimate after each chunk, as it prints them."""
    with tempfile.TemporaryDirectory() as cwd:  # where it writes its llama.log
        r = subprocess.run([str(perplexity), "-m", str(model), "-f", str(text), *PPL_ARGS], capture_output=True,
                           text=True, check=True, cwd=cwd)
    return [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", r.stdout + r.stderr)]


def model_fixture(quantize: Path, stem: str, out: Path, tmp: Path) -> None:
    """A one-layer tiny MoE as ik quantizes it (MODELS[stem]), the text, and ik's perplexity on it, on its exact
    weights and on the F16 file it came from."""
    qtype, custom_q = MODELS[stem]
    one = tmp / "one-f16.gguf"
    subprocess.run([sys.executable, "-m", "ferry", "synth", "qwen3-moe-tiny", "--layers", "1", "--type", "f16",
                    "--expert-type", "f16", "-o", str(one), "-q"], check=True, cwd=ROOT)
    model = out / f"{stem}.gguf"
    subprocess.run([str(quantize), *NO_IMATRIX, "--custom-q", custom_q, str(one), str(model), qtype, "1"], check=True,
                   capture_output=True)
    rng = random.Random(1)
    words = ("the a of and to in is was for on that with as by at from it his an were are which be this has or had not "
             "but first one their its new after who they have her she two been other when there all during into school "
             "time may years more most only over city some world would where later up such used many can").split()
    text = out / "qwen3moe-ik.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    perplexity = quantize.with_name("llama-perplexity")
    f32 = tmp / "model-f32.gguf"  # the file's weights as ik dequantizes them: the figure without activation rounding
    subprocess.run([str(quantize), "--allow-requantize", str(model), str(f32), "F32", "1"], check=True,
                   capture_output=True)
    ref = {"args": PPL_ARGS, "type": qtype, "custom_q": custom_q, "ppl": ik_ppl(perplexity, model, text),
           "ppl_f32": ik_ppl(perplexity, f32, text), "ppl_f16": ik_ppl(perplexity, one, text)}
    (out / f"{stem}.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"model: {model} ({model.stat().st_size} bytes), ik's ppl {ref['ppl'][-1]} (F16: {ref['ppl_f16'][-1]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tarball", default=str(ROOT.parent / "shared" / "anchors" / "ik_llama.cpp-8337e4c.tar.gz"))
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--models", default=",".join(MODELS), help="the whole models to write ('' for none)")
    a = ap.parse_args()
    quantize = build(Path(a.tarball), Path.home() / ".cache" / "ferry-anchors" / "ik")
    out = ROOT / "tests" / "fixtures" / "ik"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "f16.gguf"
        subprocess.run([sys.executable, "-m", "ferry", "synth", "qwen3-moe-tiny", "--type", "f16", "--expert-type",
                        "f16", "-o", str(f16), "-q"], check=True, cwd=ROOT)
        for name in filter(None, a.types.split(",")):
            quantized, back = Path(tmp) / f"{name}.gguf", Path(tmp) / f"{name}-f32.gguf"
            custom = ["--custom-q", f"ffn_.*_exps={name.lower()},attn_.*={name.lower()}"] if name in CUSTOM else []
            subprocess.run([str(quantize), *NO_IMATRIX, *custom, str(f16), str(quantized), CUSTOM.get(name, name), "1"],
                           check=True, capture_output=True)
            if NO_F32.get(name, "F32") != "truncated":
                subprocess.run([str(quantize), "--allow-requantize", *NO_IMATRIX, str(f16 if name in NO_F32 else quantized),
                                str(back), NO_F32.get(name, "F32"), "1"], check=True, capture_output=True)
            f = GGUFFile(quantized, ik=True)
            of_type = [n for n in f.ik_tensors() if IK_TYPES[f.ik_tensor(n)[0]][0] == name]
            tensor = min(of_type, key=lambda n: np.prod(f.ik_tensor(n)[1]))
            raw_type, ne, data = f.ik_tensor(tensor)
            g = GGUFFile(f16 if name == "BF16_R16" else back)
            t = g.tensor(tensor)
            theirs = dequantize(g.data(t), t.qtype, t.ne)
            if name == "BF16_R16":
                theirs = (theirs.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
            data, theirs = data[:ROWS * ik_type_bytes(raw_type, (ne[0], 1))], theirs.reshape(-1, ne[0])[:ROWS]
            ne = (ne[0], ROWS)
            np.savez_compressed(out / f"{name}.npz", raw=np.array(data), raw_type=raw_type, ne=np.array(ne),
                                ik_values=theirs.astype(np.float32))
            print(f"{name}: {tensor} {list(ne)}, {data.nbytes} bytes -> {out / (name + '.npz')}")
        for stem in filter(None, a.models.split(",")):
            model_fixture(quantize, stem, out, Path(tmp))


if __name__ == "__main__":
    main()
