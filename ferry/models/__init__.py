"""Model families, one file each, and the registry from GGUF architecture name to builder."""

from __future__ import annotations

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.models import deepseek2, deepseek4, gemma3, glm4moe, gptoss, llama, minimax_m2, qwen3moe, qwen35moe
from ferry.models.base import Model, ModelArgs, WeightLoader

ARCHITECTURES = {
    "llama": llama.build,
    "qwen2": llama.build,
    "qwen3": llama.build,
    "qwen3moe": qwen3moe.build,
    "gemma3": gemma3.build,
    "deepseek2": deepseek2.build,
    "deepseek32": deepseek2.build,
    "glm-dsa": deepseek2.build,
    "deepseek4": deepseek4.build,
    "glm4moe": glm4moe.build,
    "gpt-oss": gptoss.build,
    "minimax-m2": minimax_m2.build,
    "qwen35": qwen35moe.build,
    "qwen35moe": qwen35moe.build,
    "qwen3next": qwen35moe.build,
}


def load_model(f: GGUFFile, mla: int | None = None, max_batch_mib: int = 0) -> Model:
    """Build the model described by an open GGUF file; every tensor is checked against the metadata. `mla`, `max_batch_mib`:
    the latent attention mode of deepseek2 models and its -amb (Model.use_mla)."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise FerryError(f"{f.path}: architecture '{arch}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    args = ModelArgs.from_gguf(f)
    loader = WeightLoader(f)
    model = ARCHITECTURES[arch](loader, args)
    unused = sorted(set(f.tensors) - loader.used)
    if unused:
        raise FerryError(f"{f.path}: {len(unused)} tensors are not used by '{arch}' (first: '{unused[0]}'); the file does not match its architecture")
    model.use_mla(mla, max_batch_mib)
    return model
