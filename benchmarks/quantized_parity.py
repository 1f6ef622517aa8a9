"""ferry against llama.cpp on files made the way users' files are made: tiny random HF models converted by llama.cpp's
own converter (f32), then quantized by llama.cpp's own quantizer (its per-tensor type mix: Q4_K_M keeps some
tensors in Q6_K, falls back where a row is not a multiple of 256, ...). Both engines run each file on the CPU over
the same tokens; per position, the KL divergence of ferry's next-token distribution from llama.cpp's, and top-1
agreement. Prints a table, writes JSON. llama.cpp (llama-cpp-python) runs in a subprocess (two libggml copies
clash in one process).
  python benchmarks/quantized_parity.py [--families qwen3moe,mixtral,glm4moe,deepseek2,deepseek3] [--types Q8_0,Q4_K_M]
      [--out quantized_parity.json]
Needs llama-cpp-python (see benchmarks/gemma_agreement.py) and the converter's tree (benchmarks/llamacpp.py converter).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
N_TOKENS, N_PROMPT = 48, 32


def _llama_side(model: str, ftype: str, out: str, tokens: list[int]) -> None:
    """In the subprocess: quantize `model` to `ftype` (unless F32) at out + '.gguf', evaluate the tokens (a prompt
    of N_PROMPT, then one at a time), save the logits."""
    import llama_cpp
    import numpy as np

    path = model
    if ftype != "F32":
        path = out + ".gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        if llama_cpp.llama_model_quantize(model.encode(), path.encode(), params) != 0:
            sys.exit(f"llama.cpp could not quantize {model} to {ftype}")
    # flash attention, as ferry always attends (-fa 0 is refused): without it llama.cpp rounds K.Q otherwise
    llm = llama_cpp.Llama(path, n_ctx=128, n_batch=N_PROMPT, n_threads=2, logits_all=True, verbose=False,
                          flash_attn=True)
    llm.eval(tokens[:N_PROMPT])
    for t in tokens[N_PROMPT:]:
        llm.eval([t])
    np.save(out + ".npy", np.array(llm.scores[:len(tokens)], dtype=np.float32))


def main() -> None:
    if sys.argv[1:2] == ["--llama-side"]:
        _llama_side(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (llama.cpp takes a deepseek2 file without q_lora_rank for V2-Lite only at 26 or 27 layers: no tiny V2-Lite)
    ap.add_argument("--families", default="qwen3moe,mixtral,glm4moe,deepseek2,deepseek3")
    ap.add_argument("--types", default="F32,Q8_0,Q6_K,Q4_K_M,IQ4_XS,Q2_K")
    ap.add_argument("--out", default="quantized_parity.json")
    a = ap.parse_args()
    import numpy as np
    import torch

    from benchmarks.llamacpp import converter
    from ferry.gguf.file import GGUFFile
    from ferry.models import load_model
    from ferry.backends.cpu import CpuBackend
    from ferry.runtime.engine import Engine
    from tests.fixtures.hf import VOCAB, save_tiny_tokenizer, tiny_hf_model

    tree = converter()
    tokens = torch.randint(0, VOCAB, (N_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    backend = CpuBackend(2)
    rows = []
    print("| family | type | file MB | tensor types | KL median | KL max | top-1 |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            folder, f32 = Path(tmp) / family, Path(tmp) / f"{family}.gguf"
            tiny_hf_model(family).save_pretrained(folder)
            save_tiny_tokenizer(folder)
            subprocess.run([sys.executable, str(ROOT / "tests/fixtures/llamacpp_convert.py"), str(tree), str(folder),
                            str(f32)], check=True, capture_output=True)
            for ftype in a.types.split(","):
                out = str(Path(tmp) / f"{family}-{ftype}")
                subprocess.run([sys.executable, __file__, "--llama-side", str(f32), ftype, out, json.dumps(tokens)],
                               check=True)
                ref = torch.from_numpy(np.load(out + ".npy")).double()
                path = f32 if ftype == "F32" else Path(out + ".gguf")
                f = GGUFFile(path)
                types = sorted({t.qtype.name for t in f.tensors.values()})
                engine = Engine(load_model(f), backend, n_ctx=128, n_ubatch=N_PROMPT)
                got = torch.cat([engine.decode(tokens[:N_PROMPT], all_logits=True)]
                                + [engine.decode([t], all_logits=True) for t in tokens[N_PROMPT:]]).double()
                lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
                kl = (lp.exp() * (lp - lq)).sum(-1)
                top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
                row = {"family": family, "type": ftype, "mb": path.stat().st_size / 1e6, "tensor_types": types,
                       "kl_median": kl.median().item(), "kl_max": kl.max().item(), "top1": top1}
                rows.append(row)
                print(f"| {family} | {ftype} | {row['mb']:.2f} | {' '.join(types)} | {row['kl_median']:.2e} | "
                      f"{row['kl_max']:.2e} | {top1:.3f} |", flush=True)
    Path(a.out).write_text(json.dumps({"tokens": tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
