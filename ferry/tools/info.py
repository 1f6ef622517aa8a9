"""`ferry info FILE`: architecture, sizes, quant types per tensor group, and each group's placement."""

from __future__ import annotations

import json
import re
from collections import defaultdict

from ferry.gguf.file import GGUFFile
from ferry.kernels.cpu import native
from ferry.models.base import ModelArgs
from ferry.kernels.capabilities import cpu_repack
from ferry.placement import place


def tensor_groups(f: GGUFFile, n_layer: int, n_gpu_layers: int, overrides, repack: bool = True) -> list[dict]:
    """Tensors grouped by name with the layer number folded out ('blk.*.attn_q.weight'). A CPU tensor's
    layout is 'repacked' where ggml has an interleaved layout for it (-rtr, the default), 'rewritten' or
    'de-interleaved' where it is stored in one of ik_llama.cpp's types and copied at load, else 'mmap'."""
    groups: dict[tuple, dict] = {}
    for t in f.tensors.values():
        group = re.sub(r"^blk\.\d+\.", "blk.*.", t.name)
        device = place(t.name, n_layer, n_gpu_layers, overrides)
        layout = "" if device != "CPU" else "repacked" if repack and cpu_repack(t.qtype, t.ne) else "mmap"
        if t.ik_type or t.interleaved:
            layout = "rewritten" if t.ik_type else "de-interleaved"
        kind = t.qtype.name if not (t.ik_type or t.interleaved) else f"{t.stored_as} as {t.qtype.name}"
        g = groups.setdefault((group, kind, device), {"group": group, "type": kind, "device": device,
                                                               "cpu_layout": layout, "count": 0, "bytes": 0,
                                                               "shape": list(reversed(t.ne))})
        g["count"] += 1
        g["bytes"] += t.nbytes
    return list(groups.values())


def info(cfg, as_json: bool) -> dict:
    """`ferry info` of cfg's model under its -ngl / -ot / --no-repack / -mla (a RunConfig)."""
    from ferry.layers.cache import describe_cache, mla_mode

    n_gpu_layers, override_specs, repack, mla = cfg.n_gpu_layers, cfg.override_tensor, cfg.repack, cfg.mla
    f = GGUFFile(cfg.model_path, ik_in_place=native.ik_in_place())
    args = ModelArgs.from_gguf(f)
    mode = mla_mode(args, mla)
    kv_per_token, kv_line = describe_cache(args, mode)  # f16, llama.cpp's default
    overrides = cfg.overrides
    groups = tensor_groups(f, args.n_layer, n_gpu_layers, overrides, repack)
    n_params = sum(t.n_elements for t in f.tensors.values())
    by_device: dict[str, int] = defaultdict(int)
    for g in groups:
        by_device[g["device"]] += g["bytes"]
    report = {"file": str(f.path), "parts": len(f.paths), "gguf_version": f.version, "architecture": args.arch,
              "name": f.get("general.name"), "parameters": n_params, "file_bytes": f.n_bytes,
              "args": vars(args), "bytes_by_device": dict(by_device), "tensor_groups": groups,
              "kv_bytes_per_token_f16": kv_per_token, "mla": mode}
    if as_json:
        print(json.dumps(report, indent=1))
        return report
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{f.path.name}[/]  {args.arch}  {report['name'] or ''}  GGUF v{f.version}, {len(f.paths)} part(s)")
    console.print(f"{n_params / 1e9:.3f} B parameters, {f.n_bytes / 2**30:.2f} GiB on disk")
    fields = ", ".join(f"{k}={v}" for k, v in vars(args).items() if k != "arch" and v not in (0, 0.0))
    console.print(fields)
    console.print(kv_line)
    table = Table("tensor group", "type", "count", "shape (one)", "MiB", "device", "CPU layout")
    for g in sorted(groups, key=lambda g: (g["group"].startswith("blk"), g["group"])):
        table.add_row(g["group"], g["type"], str(g["count"]), str(g["shape"]), f"{g['bytes'] / 2**20:.1f}", g["device"],
                      g["cpu_layout"])
    console.print(table)
    if any(g["cpu_layout"] == "repacked" for g in groups):
        console.print("repacked: copied at load into ggml's interleaved CPU layout, which the CPU's kernels read (a GPU "
                      "that takes them streams them from the mmap); --no-repack keeps the mmap alone", soft_wrap=True)
    for line in f.ik_lines():
        console.print(line, soft_wrap=True)
    console.print("placement: " + ", ".join(f"{d} {b / 2**30:.2f} GiB" for d, b in sorted(by_device.items())) +
                  f"  (-ngl {n_gpu_layers}" + "".join(f" -ot {s}" for s in override_specs) + ")")
    return report
