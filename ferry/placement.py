"""-ngl / -ot rules -> a device per tensor, with llama.cpp's meaning; and the memory plan.

-ngl N puts the last N repeating layers on the GPU (the output layer too when N > n_layer), split over
several GPUs in proportion to -ts/--tensor-split (default: their memory); the token embedding stays on
the CPU. -ot REGEX=DEVICE rules (searched in order, first match wins) override that per tensor name.
The memory plan adds up, per device and before anything is loaded, the weights placed there, the KV
cache of the layers placed there and an estimate of the compute buffer, and says what to change when
something does not fit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ferry.errors import FerryError
from ferry.config import settings
from ferry.layers.cache import CacheLayout, cache_layout, kv_type, state_layout
from ferry.quant import bytes_per_weight

GIB = 2 ** 30
_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")  # a layer's stacked routed experts
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


def layer_devices(n_layer: int, n_gpu_layers: int, gpus: list[str], split: list[float] | None = None) -> list[str]:
    """The device of each layer 0..n_layer (n_layer: the output layer): the last n_gpu_layers on the GPUs,
    in consecutive runs sized in proportion to `split` (llama.cpp's -ts; equal when absent)."""
    first = max(n_layer + 1 - n_gpu_layers, 0) if n_gpu_layers > 0 and gpus else n_layer + 1
    devices = ["CPU"] * (n_layer + 1)
    n_gpu = n_layer + 1 - first
    weights = split or [1.0] * len(gpus)
    total = sum(weights)
    bounds, acc = [], 0.0
    for w in weights:
        acc += w
        bounds.append(round(n_gpu * acc / total))
    for k in range(n_gpu):
        devices[first + k] = gpus[next(g for g, b in enumerate(bounds) if k < b)]
    return devices


def place(name: str, n_layer: int, n_gpu_layers: int, overrides: list[Override],
          layers: list[str] | None = None) -> str:
    """The device a tensor lives on (`layers`: layer_devices(...); one GPU, CUDA0, when absent)."""
    for rule in overrides:
        if rule.pattern.search(name):
            return rule.device
    layers = layers or layer_devices(n_layer, n_gpu_layers, ["CUDA0"])
    m = _LAYER_RE.match(name)
    if m:
        return layers[int(m.group(1))]
    if name.startswith(("output", "output_norm")):
        return layers[n_layer]
    return "CPU"  # token_embd and other input tensors


def tensor_split(text: str | None, gpus: list[str]) -> list[float] | None:
    """-ts: one non-negative share per GPU."""
    if not text:
        return None
    try:
        split = [float(x) for x in text.split(",")]
    except ValueError:
        split = []
    if len(split) != len(gpus) or any(not x >= 0 for x in split) or sum(split) <= 0:
        raise FerryError(f"-ts/--tensor-split '{text}': give {len(gpus)} non-negative numbers, one per GPU "
                         f"({', '.join(gpus) or 'none visible'}), e.g. -ts {','.join(['1'] * max(len(gpus), 1))}")
    return split


def host_memory() -> int | None:
    """Bytes of RAM available (MemAvailable), None where the system does not say."""
    try:
        with open("/proc/meminfo") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable"))
    except (OSError, StopIteration, ValueError):
        return None


def kv_bytes(type_k: str, type_v: str) -> tuple[float, float]:
    """Bytes per cached key and value value under -ctk / -ctv."""
    return (bytes_per_weight(kv_type("-ctk/--cache-type-k", type_k)),
            bytes_per_weight(kv_type("-ctv/--cache-type-v", type_v)))


def parse_size(text: str) -> int:
    """'80GiB', '512 MiB', '1.5G' -> bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise FerryError(f"'{text}' is not a size like 80GiB or 512MiB")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index((m.group(2) or "B").upper()))


def parse_gpu_memory(specs: list[str]) -> dict[str, int]:
    """--gpu-memory CUDA0=80GiB[,CUDA1=...]: the memory to plan for, instead of what the GPUs report free."""
    out = {}
    for spec in specs:
        for item in filter(None, spec.split(",")):
            device, sep, size = item.partition("=")
            device = device.strip().upper()
            if not sep or not re.fullmatch(r"CUDA\d+", device):
                raise FerryError(f"--gpu-memory '{item}' is not CUDAn=SIZE; example: --gpu-memory CUDA0=80GiB")
            out[device] = parse_size(size)
    return out


def parse_gpu_experts(spec: str | None) -> dict[int, tuple[int, ...]]:
    """--gpu-experts 'LAYER:EXPERTS[;LAYER:EXPERTS...]' (EXPERTS: ids and ranges, '0-31,40'): routed experts kept on
    the GPU while the rest of their layer's experts stay in RAM -> {layer: sorted expert ids}."""
    out: dict[int, tuple[int, ...]] = {}
    for item in filter(None, (spec or "").replace(" ", "").split(";")):
        layer, sep, experts = item.partition(":")
        ids: set[int] = set()
        try:
            if not sep or not experts:
                raise ValueError
            for part in experts.split(","):
                lo, dash, hi = part.partition("-")
                a, b = int(lo), int(hi) if dash else int(lo)
                if a < 0 or b < a:
                    raise ValueError
                ids.update(range(a, b + 1))
            n = int(layer)
        except ValueError:
            raise FerryError(f"--gpu-experts '{item}' is not LAYER:EXPERTS; example: --gpu-experts '3:0-31,40;7:5'") \
                from None
        out[n] = tuple(sorted(ids | set(out.get(n, ()))))
    return out


def expert_runs(experts: list[int]) -> list[tuple[int, int]]:
    """Sorted expert ids as [first, last + 1) runs of neighbours: one copy per run (the streamer), one range of
    --gpu-experts."""
    runs: list[tuple[int, int]] = []
    for e in experts:
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs


def format_gpu_experts(resident: dict[int, tuple[int, ...]]) -> str:
    """The --gpu-experts text of a placement, runs of neighbours as ranges."""
    return ";".join(f"{layer}:" + ",".join(str(a) if b == a + 1 else f"{a}-{b - 1}" for a, b in expert_runs(ids))
                    for layer, ids in sorted(resident.items()))


def resident_bytes(tensors: dict[str, int], resident: dict[int, tuple[int, ...]], n_expert: int) -> int:
    """The bytes of resident experts (--gpu-experts): each expert's share of its layer's three stacked tensors."""
    total = 0
    for layer, ids in resident.items():
        per_layer = sum(tensors.get(f"blk.{layer}.ffn_{p}_exps.weight", 0) for p in ("gate", "up", "down"))
        total += per_layer * len(ids) // max(n_expert, 1)
    return total


@dataclass
class DeviceNeed:
    device: str
    weights: int = 0
    kv_cache: int = 0
    compute: int = 0
    available: int | None = None  # None: not known (no such GPU here and none given)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute

    @property
    def over(self) -> int:
        return 0 if self.available is None else max(0, self.total - self.available)


@dataclass
class MemoryPlan:
    devices: list[DeviceNeed] = field(default_factory=list)
    advice: str = ""

    @property
    def fits(self) -> bool:
        return all(d.over == 0 for d in self.devices)

    def error(self) -> str:
        bad = [d for d in self.devices if d.over]
        parts = [f"{d.device} needs {d.total / GIB:.2f} GiB (weights {d.weights / GIB:.2f}, KV cache "
                 f"{d.kv_cache / GIB:.2f}, compute {d.compute / GIB:.2f}) of {d.available / GIB:.2f} GiB, "
                 f"{d.over / GIB:.2f} GiB over" for d in bad]
        return "the model does not fit: " + "; ".join(parts) + (f"; {self.advice}" if self.advice else "")


def as_loaded(tensors: dict[str, int], args) -> dict[str, int]:
    """The bytes a loaded model holds per tensor, from the file's: deepseek2 keeps float32 copies of each layer's
    k_b and v_b (latent attention's absorbed form, and its expanded form in torch) in RAM in place of a file's
    attn_k_b / attn_v_b, a float16 copy of them on the GPU that runs the layer's attention, and kv_b (the file's
    attn_kv_b, or joined in float32 from k_b / v_b) for ggml's graphs only: memory_plan counts kv_b where its layer
    is on the CPU (models/deepseek2.py, layers/attention.py, CudaBackend.half)."""
    if args.kv_lora_rank <= 0:
        return tensors
    out = dict(tensors)
    nope = args.head_dim_k - args.n_rot
    per_layer = 4 * args.n_head * args.kv_lora_rank * (nope + args.head_dim_v)  # one float32 copy of kv_b
    for i in range(args.n_layer):
        p = f"blk.{i}."
        if p + "attn_k_b.weight" in out:
            del out[p + "attn_k_b.weight"], out[p + "attn_v_b.weight"]
            out[p + "attn_kv_b.weight"] = per_layer
        out[p + "attn_k_b_v_b.float32"] = per_layer
        out[p + "attn_k_b_v_b.float16"] = per_layer // 2
    return out


def _ggml_only(name: str) -> bool:
    """A tensor only ggml's graphs read (deepseek2's kv_b): held where its layer runs on the CPU, nowhere else."""
    return name.endswith(".attn_kv_b.weight")


def expanding_layers(tensors) -> frozenset[int]:
    """The layers whose routed experts the GPU's split kernels do not read, which stream as copied (streamer.Compact):
    any of such a type (a Q4_K_M file's K-quants; HybridBackend._expands). tensors: a file's tensor records (name,
    qtype)."""
    from ferry.kernels.capabilities import gpu_reads

    return frozenset(layer for layer, qs in _expert_types(tensors).items() if not gpu_reads(qs))


def expanded_layers(tensors) -> frozenset[int]:
    """The layers whose routed experts no quantized kernel of the GPU reads (IQ4_XS, Q3_K...: not the split kernels',
    not kquant.py's), which its prompts expand to bfloat16 a projection at a time."""
    from ferry.kernels.capabilities import gpu_holds

    return frozenset(layer for layer, qs in _expert_types(tensors).items() if not gpu_holds(qs))


def _expert_types(tensors) -> dict[int, set]:
    types: dict[int, set] = {}
    for t in tensors:
        m = EXPERTS_RE.match(t.name)
        if m:
            types.setdefault(int(m.group(1)), set()).add(t.qtype)
    return types


def memory_plan(tensors: dict[str, int], args, n_gpu_layers: int, overrides: list[Override], gpus: list[str],
                available: dict[str, int], n_ctx: int, n_ubatch: int, kv_bytes_per_value: tuple[float, float] = (2, 2),
                split: list[float] | None = None, advise: bool = True, kv_on_gpu: bool = False,
                cache: CacheLayout | None = None, n_batch: int = 0,
                resident: dict[int, tuple[int, ...]] | None = None, expands: frozenset[int] = frozenset(),
                n_logits: int | None = None, expanded: frozenset[int] | None = None, n_seq: int = 1) -> MemoryPlan:
    """Bytes per device: `tensors` maps names to sizes (as a GPU holds them: capabilities.gpu_nbytes, at most 2.8%
    over the file's for dense K-quants); the KV cache of a layer lives with its attention
    weights (kv_on_gpu: every layer's on the first GPU, as ferry's hybrid runtime keeps it); the compute
    estimate is a u-batch of float32 activations through the widest layer and the logits, plus, on the first
    GPU, the staging buffers for routed experts left in RAM (a layer's slots and the buffer copies land in; two sets
    of three of the largest expert tensors where the experts stay as copied).
    `available`: free bytes per device (CPU: RAM). `cache`: what the KV cache holds per position (default: the
    model's keys and values; MLA's latent: Model.cache_layout). `n_batch`: the logical
    batch whose rows meet at each MoE layer when routed experts in RAM are taken layer first (0: not so), whose
    activations and expert buffers then add to the first GPU's. `resident`: experts of layers in RAM kept on the first
    GPU too (--gpu-experts). `expands`: the layers whose routed experts the GPU's split kernels do not read
    (expanding_layers): streamed, they stay as copied in two staging sets of their own. `expanded`: those of them no
    quantized kernel reads (expanded_layers; None: all of `expands`), whose prompts, on a GPU, in RAM or kept there,
    expand a projection at a time in one bfloat16 scratch a device. `n_logits`: the rows of logits a u-batch
    computes (RunConfig.logit_rows; None: all n_ubatch, as perplexity's). `n_seq`: the sequences (server slots) a
    recurrent layer or a compressor keeps a state for, each over n_ctx / n_seq positions (and a sliding-window layer a
    ring: CacheLayout.ring)."""
    layers = layer_devices(args.n_layer, n_gpu_layers, gpus, split)
    tensors = as_loaded(tensors, args)
    needs: dict[str, DeviceNeed] = {}

    def need(device: str) -> DeviceNeed:
        return needs.setdefault(device, DeviceNeed(device, available=available.get(device)))

    for name, size in tensors.items():
        device = place(name, args.n_layer, n_gpu_layers, overrides, layers)
        if name.endswith(".attn_k_b_v_b.float32"):
            device = "CPU"  # the model's own copy, whichever device runs the layer
        elif name.endswith(".attn_k_b_v_b.float16"):
            if kv_on_gpu:
                device = gpus[0]  # the hybrid runtime attends on the GPU, every layer
            elif device == "CPU":
                continue  # only a GPU makes this copy
        if device == "CPU" or not _ggml_only(name):
            need(device).weights += size
    if resident:
        need(gpus[0]).weights += resident_bytes(tensors, resident, args.n_expert)
    # a prompt through a GPU's experts that no grouped GEMM of its reads (expanded) expands one projection of the
    # layer's experts at a time to bfloat16, in one scratch buffer a device (the first GPU's serves the experts it
    # streams or keeps of such layers in RAM too)
    scratch = 2 * args.n_embd * args.n_ff_exp * args.n_expert
    expanded = expands if expanded is None else expanded
    expanding = set()
    for i in sorted(expanded):
        name = f"blk.{i}.ffn_down_exps.weight"
        if name in tensors:
            device = place(name, args.n_layer, n_gpu_layers, overrides, layers)
            if device != "CPU":
                expanding.add(device)
            elif kv_on_gpu and f"blk.{i}.ffn_down_exps.bias" not in tensors:  # biased ones stay with the CPU (work.py)
                expanding.add(gpus[0])
    if any(i in expanded for i in (resident or {})):
        expanding.add(gpus[0])
    for device in expanding:
        need(device).compute += scratch
    kb, vb = kv_bytes_per_value
    cache = cache or cache_layout(args, 0)
    ring = cache.ring(n_ctx // n_seq, n_ubatch)  # the sliding-window layers' rows per sequence (0: every position)
    state = state_layout(args)  # a recurrent layer keeps its state (one per sequence) instead of KV rows
    per_state = n_seq * state.bytes_per_sequence // len(state.layers) if state else 0
    for i in range(args.n_layer):
        kv_device = gpus[0] if kv_on_gpu else place(f"blk.{i}.attn_k.weight", args.n_layer, n_gpu_layers, overrides,
                                                     layers)
        per_layer = int(cache.rows(i, n_ctx, n_seq, ring) * cache.bytes_per_position(kb, vb))
        need(kv_device).kv_cache += per_state if state and i in state.layers else per_layer + n_ctx * cache.index_bytes(i, kb)
        need(kv_device).kv_cache += n_seq * sum(4 * c.dim * c.entries(n_ctx // n_seq) + c.ring_bytes
                                                for c in cache.compressed if c.layer == i)
    # a GPU replays prompt u-batches (and batches of them) up to Settings.prompt_graph_max tokens as CUDA graphs, whose
    # memory pool is a second set of their activations beside the eager one
    replayed = n_ubatch <= settings().prompt_graph_max
    if kv_on_gpu:
        in_ram: dict[str, int] = {}  # the routed experts in RAM the GPU streams, per layer
        largest = 0  # the largest stacked expert tensor in RAM
        for name, size in tensors.items():
            m = _LAYER_RE.match(name)
            # biased experts the GPU would expand are never streamed (offload/work.gpu_refuses): they stage nothing
            if (m and name.endswith("_exps.weight") and not (int(m.group(1)) in expands and
                                                              f"blk.{m.group(1)}.ffn_down_exps.bias" in tensors)
                    and place(name, args.n_layer, n_gpu_layers, overrides, layers) == "CPU"):
                in_ram[m.group(1)] = in_ram.get(m.group(1), 0) + size
                largest = max(largest, size)
        # the streamer's buffers: for experts spread to a Split's slots, one set of slots and the compact buffer
        # copies land in (the largest tensor); for experts left as copied (streamer.Compact), two sets of three
        # buffers of the largest
        spread = max((v for i, v in in_ram.items() if int(i) not in expands), default=0)
        if spread:
            need(gpus[0]).compute += spread + largest
        if any(int(i) in expands for i in in_ram):
            need(gpus[0]).compute += 2 * 3 * largest
        if in_ram and n_batch:  # the batch's residual and normed rows per u-batch and joined; each pair's rows
            k = max(args.n_expert_used, 1)
            joined = 4 * n_batch * (4 * args.n_embd + k * (args.n_embd + args.n_ff_exp))
            need(gpus[0]).compute += joined * (2 if replayed else 1)
    width = max(args.n_ff, args.n_ff_exp * max(args.n_expert_used, 1), args.n_head * args.head_dim_k)
    activations = 4 * n_ubatch * (4 * args.n_embd + 3 * width)
    for d in {place(f"blk.{i}.ffn_up.weight", args.n_layer, n_gpu_layers, overrides, layers) for i in range(args.n_layer)}:
        need(d).compute += activations * (2 if d != "CPU" and replayed else 1)
    rows = n_ubatch if n_logits is None else n_logits
    need(place("output.weight", args.n_layer, n_gpu_layers, overrides, layers)).compute += 4 * rows * args.n_vocab
    plan = MemoryPlan(sorted(needs.values(), key=lambda d: (d.device != "CPU", d.device)))
    if advise and not plan.fits:
        plan.advice = _advice(plan, tensors, args, n_gpu_layers, overrides, gpus, available, n_ctx, n_ubatch,
                              kv_bytes_per_value, split, kv_on_gpu, cache, n_batch, expands, n_logits, expanded, n_seq)
    return plan


def _advice(plan, tensors, args, n_gpu_layers, overrides, gpus, available, n_ctx, n_ubatch, kv, split,
            kv_on_gpu, cache, n_batch, expands, n_logits, expanded, n_seq) -> str:
    gpu_over = any(d.over for d in plan.devices if d.device != "CPU")
    if gpu_over:
        for ngl in range(min(n_gpu_layers, args.n_layer + 1) - 1, -1, -1):
            if memory_plan(tensors, args, ngl, overrides, gpus, available, n_ctx, n_ubatch, kv, split, False,
                           kv_on_gpu and ngl > 0, cache, n_batch, expands=expands, n_logits=n_logits,
                           expanded=expanded, n_seq=n_seq).fits:
                return f"-ngl {ngl} fits; or keep the experts in RAM with -ot exps=CPU, or lower -c/--ctx-size"
        return ("no -ngl fits: lower -c/--ctx-size, -ub/--ubatch-size" + (", -b/--batch-size" if n_batch else "")
                + " or use a smaller quant type")
    return "not enough RAM: put more layers on the GPU (-ngl), lower -c/--ctx-size or use a smaller quant type"
