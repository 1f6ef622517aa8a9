"""Where the time of the hybrid runtime goes (experts in RAM, -ngl 999 -ot exps=CPU): per MoE layer, the route and
host sync, the CPU's ggml work and the rest (copies, GPU work, upload), measured by synchronizing around each op
(--verbose's records); beside them the floors: ggml on one token's experts called alone, a GPU->host round trip,
and the all-GPU part of a decode step.
  python benchmarks/profile_hybrid.py -m model.gguf [-t 16] [--policy all=off] [-n 16] [-ub 128]
"""

import argparse
import dataclasses
import statistics
import time

import torch

from ferry.runtime.loader import RunConfig, load
from ferry.offload.policy import parse_policy
from ferry.runtime.engine import Engine


def best(fn, reps: int = 30) -> float:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def decode_rate(engine, backend, n: int) -> float:
    """Tokens per second of n single-token decode steps."""
    backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.decode([1])
    backend.synchronize()
    return n / (time.perf_counter() - t0)


def summary(records, label: str) -> None:
    moe = [r for r in records if r.op == "mul_mat_id"]
    if not moe:
        return
    per = {k: statistics.mean(r.parts.get(k, 0.0) for r in moe) for k in ("route", "cpu")}
    total = statistics.mean(r.measured_s for r in moe)
    pred = statistics.mean(r.predicted_s for r in moe)
    where = sorted({r.device for r in moe})[:4]
    print(f"{label}: {len(moe)} MoE layer calls; mean ms: total {1e3 * total:.3f} (predicted {1e3 * pred:.3f}), "
          f"route+sync {1e3 * per['route']:.3f}, ggml {1e3 * per['cpu']:.3f}, rest {1e3 * (total - per['route'] - per['cpu']):.3f}; "
          f"placements {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("--policy", default="all=off;auto;auto0;all=on")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-ub", default="128")
    a = ap.parse_args()
    loaded = load(RunConfig(a.model, n_threads=a.threads, quiet=True, n_gpu_layers=999, override_tensor=["exps=CPU"],
                            verbose=True, n_ctx=4096, n_ubatch=4096))
    backend, model = loaded.backend, loaded.model
    print(backend.describe())
    print("calibration:", backend.calib)
    vocab = model.args.n_vocab
    blk = next(b.ffn for b in model.blocks if hasattr(b.ffn, "up_exps"))  # the first MoE layer (after dense ones)
    x = torch.randn(1, model.args.n_embd)
    ids = torch.randperm(model.args.n_expert)[:model.args.n_expert_used].view(1, -1).int()
    w = torch.full((1, model.args.n_expert_used), 1.0 / model.args.n_expert_used)
    t = best(lambda: backend.cpu.moe_experts(x, ids, w, blk.up_exps, blk.gate_exps, blk.down_exps, "silu"))
    nbytes = sum(t_.data.nbytes for t_ in (blk.up_exps, blk.gate_exps, blk.down_exps)) / model.args.n_expert
    print(f"floor: ggml, one token's {model.args.n_expert_used} experts alone: {1e3 * t:.3f} ms "
          f"({model.args.n_expert_used * nbytes / t / 1e9:.1f} GB/s)")
    # can a PCIe copy from the registered mmap run while ggml computes? (the split MoE assumes so)
    stream = backend.streamer
    n_e = model.args.n_expert
    hot, cold = list(range(0, n_e, 2)), torch.arange(1, n_e, 2, dtype=torch.int32)
    xc = torch.randn(4 * len(cold), model.args.n_embd)
    ec = cold.repeat(4).view(-1, 1)

    def copy():
        staged = stream.stage_experts([blk.gate_exps, blk.up_exps, blk.down_exps], hot, ("moe", 0))
        staged[-1][1].synchronize()

    def compute():
        backend.cpu.moe_experts(xc, ec, None, blk.up_exps, blk.gate_exps, blk.down_exps, "silu")

    def both():
        staged = stream.stage_experts([blk.gate_exps, blk.up_exps, blk.down_exps], hot, ("moe", 0))
        compute()
        staged[-1][1].synchronize()

    tc, tg_, tb = best(copy, 10), best(compute, 10), best(both, 10)
    print(f"overlap: copy {len(hot)} experts {1e3 * tc:.3f} ms ({len(hot) * nbytes / tc / 1e9:.1f} GB/s), "
          f"ggml on {len(cold)} experts x 4 tokens {1e3 * tg_:.3f} ms, both at once {1e3 * tb:.3f} ms "
          f"(sum {1e3 * (tc + tg_):.3f}, max {1e3 * max(tc, tg_):.3f})")
    g = torch.zeros(8, device=backend.device)
    print(f"floor: GPU->host round trip of 8 numbers: {1e6 * best(lambda: g.cpu()):.1f} us")
    measured = backend.calib
    for policy in a.policy.split(";"):
        # "auto0": auto as if GPU launches were free, so that it splits: what a split really costs
        backend.calib = dataclasses.replace(measured, launch_s=0.0) if policy == "auto0" else measured
        backend.policy = parse_policy("auto" if policy == "auto0" else policy)
        e = Engine(model, backend, n_ctx=4096, n_batch=4096, n_ubatch=max(int(u) for u in a.ub.split(",")))
        e.decode(torch.randint(0, vocab, (64,)).tolist())
        for _ in range(2):
            e.decode([1])
        backend.stats.records.clear()
        print(f"{policy} decode, timed per op: {decode_rate(e, backend, a.n):.2f} t/s")
        summary(backend.stats.records, f"  {policy} decode")
        backend.stats.keep = backend.timed = False
        print(f"{policy} decode, untimed: {decode_rate(e, backend, a.n):.2f} t/s")
        backend.stats.keep = backend.timed = True
        for ub in [int(u) for u in a.ub.split(",")]:
            e = Engine(model, backend, n_ctx=4096, n_batch=ub, n_ubatch=ub)
            tokens = torch.randint(0, vocab, (ub,)).tolist()
            e.decode(tokens)
            e.reset()
            backend.stats.records.clear()
            e.decode(tokens)
            summary(backend.stats.records, f"  {policy} u-batch {ub}")
    backend.close()


if __name__ == "__main__":
    main()
