"""-ngl / -ot rules -> a device per tensor, with llama.cpp's meaning.

-ngl N puts the last N repeating layers on the GPU (the output layer too when N > n_layer);
the token embedding stays on the CPU. -ot REGEX=DEVICE rules (searched in order, first match wins)
override that per tensor name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ferry.errors import FerryError

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
_DEVICE_RE = re.compile(r"^(CPU|CUDA\d+)$")


@dataclass(frozen=True)
class Override:
    pattern: re.Pattern
    device: str


def parse_overrides(specs: list[str]) -> list[Override]:
    """`-ot` values: each 'REGEX=DEVICE', or several joined by commas."""
    rules = []
    for spec in specs:
        for item in filter(None, spec.split(",")):
            regex, sep, device = item.rpartition("=")
            if not sep or not regex:
                raise FerryError(f"-ot '{item}' is not REGEX=DEVICE; example: -ot exps=CPU")
            device = device.strip().upper()
            if not _DEVICE_RE.match(device):
                raise FerryError(f"-ot '{item}': unknown device '{device}'; use CPU, CUDA0, CUDA1, ...")
            try:
                rules.append(Override(re.compile(regex), device))
            except re.error as e:
                raise FerryError(f"-ot '{item}': bad regular expression ({e})") from None
    return rules


def place(name: str, n_layer: int, n_gpu_layers: int, overrides: list[Override]) -> str:
    """The device a tensor lives on."""
    for rule in overrides:
        if rule.pattern.search(name):
            return rule.device
    first_gpu_layer = max(n_layer + 1 - n_gpu_layers, 0) if n_gpu_layers > 0 else n_layer + 1
    m = _LAYER_RE.match(name)
    if m:
        layer = int(m.group(1))
    elif name.startswith(("output", "output_norm")):
        layer = n_layer
    else:
        return "CPU"  # token_embd and other input tensors
    return "CUDA0" if layer >= first_gpu_layer else "CPU"
