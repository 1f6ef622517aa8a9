"""Experts in RAM, the rest on the GPU: ferry (`-ngl 999 -ot exps=CPU`, each offload policy) against llama.cpp's
CUDA llama-bench with the same placement and pinned weights (`-ngl 99 -ot exps=CPU -fa 1 -lm none`: no mmap, the
weights in CUDA host buffers), on the same GGUF,
in the same run: issue 5's targets (pp4096 at u-batch 512..4096, pp512 at u-batch 64..256, tg128).

ferry loads the model once and measures every policy on it (`auto` and the manual ones: all experts streamed to the
GPU, all computed by the CPU, llama.cpp's threshold rule); `auto` is also compared with the best manual one per test.
Both engines get `-b` = the prompt, so a prompt is one logical batch: ferry takes it layer first (each layer's
experts cross PCIe once per batch, its default) and, in the columns marked "ubatch-first", u-batch by u-batch
through every layer as llama.cpp does (--ubatch-first-policies).
Both engines measure llama-bench's way (a warm-up, then -r repetitions; mean ± std). The experts hit per layer in
the first u-batch stand beside every number (interleaved: per layer, the median over the runs). Without
--llama-bench, only ferry runs.
  python benchmarks/hybrid_vs_llamacpp.py --llama-bench PATH -m qwen3-30b-a3b.gguf -t 16
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402

from ferry.offload.calibrate import ggml_build  # noqa: E402
from ferry.tools.compare import paired, welch  # noqa: E402

POLICIES = ["auto", "all=on", "all=off", "threshold"]


def tests(pp_big: int, ub_big: list[int], pp_small: int, ub_small: list[int], n_gen: int) -> list[tuple[int, int, int]]:
    """(prompt, generated, u-batch) per test."""
    return [(pp_big, 0, ub) for ub in ub_big] + [(pp_small, 0, ub) for ub in ub_small] + ([(0, n_gen, 512)] if n_gen else [])


def name(p: int, n: int, ub: int) -> str:
    return f"pp{p} ub{ub}" if p else f"tg{n}"


def ferry_bench(path: Path, threads: int, cases, reps: int, policies: list[str], skip_slow_cpu: bool,
                ubatch_first: list[str], interleave: bool = False, partial: Path | None = None) -> dict:
    """Every config's runs of each test, one after another; interleave: one engine shared by the configs (one per
    batch order), warmed up once under each, then one run of each config in turn, reps times over (the order
    reversed every other time, each turn's runs on the same tokens), so that a drift of the machine's speed falls on
    every config alike and each turn is a set of pairs (for telling apart configs that do the same work)."""
    from ferry.offload.policy import Explorer, parse_policy
    from ferry.runtime.loader import RunConfig, load
    from ferry.tools.bench import Runs

    ub_max = max(ub for _, _, ub in cases)
    t0 = time.perf_counter()
    cfg = RunConfig(path, n_threads=threads, quiet=True, n_gpu_layers=999, override_tensor=["exps=CPU"],
                    n_ctx=max(p + n for p, n, _ in cases) + 1, n_ubatch=ub_max)
    loaded = load(cfg)
    backend = loaded.backend
    print(f"ferry: loaded in {time.perf_counter() - t0:.1f} s; {backend.describe()}", file=sys.stderr, flush=True)
    out: dict = {}
    layer_first = backend.layer_first
    configs = [(p, p) for p in policies] + [(p, f"{p} ubatch-first") for p in ubatch_first]
    explorers = {label: Explorer() for _, label in configs}  # each auto run measures for itself, once

    def use(policy: str, label: str) -> None:
        backend.policy = parse_policy(policy)
        backend.explorer = explorers[label]
        backend.layer_first = layer_first and not label.endswith("ubatch-first")  # read by each Engine

    for p, n, ub in cases:  # each test's runs side by side in time: no policy gains from running later
        runs = [(policy, label) for policy, label in configs
                if not (skip_slow_cpu and policy == "all=off" and p > 512)  # every expert by the CPU at 4096 tokens
                and not (label != policy and not p)]  # generation has one token per batch: no order to choose
        samples: dict[str, list[float]] = {label: [] for _, label in runs}
        copied: dict[str, int] = dict.fromkeys(samples, 0)
        n_runs: dict[str, int] = dict.fromkeys(samples, 0)  # timed runs, over which the copies are counted
        hits: dict[str, list[int]] = {}
        if interleave:
            # one engine for every config of a batch order (the policy is read at run time): configs that do the
            # same work then share every buffer, cache and recorded graph, and differ only by their policy
            shared: dict[bool, Runs] = {}  # by batch order: ubatch-first or not
            each_hit: dict[str, list[list[int]]] = {label: [] for _, label in runs}
            for policy, label in runs:
                use(policy, label)
                order = label.endswith("ubatch-first")
                if order not in shared:
                    shared[order] = Runs(loaded, cfg.with_(n_batch=p or 512, n_ubatch=ub), p, n)
                shared[order].warm_up()  # auto's trials fall in its own warm-up, a recording's second pass in one
            for i in range(reps):
                for policy, label in (runs if i % 2 == 0 else runs[::-1]):
                    use(policy, label)
                    engine = shared[label.endswith("ubatch-first")]
                    before = backend.streamer.bytes_copied
                    samples[label].append(engine.once(i))
                    copied[label] += backend.streamer.bytes_copied - before
                    n_runs[label] += 1
                    each_hit[label].append(engine.experts_hit)  # read after the run: not timed
            del shared  # their caches and recorded graphs
            # how many experts a first u-batch reaches depends on its tokens (one seed's 16 tokens route to the
            # same 8 in every deep layer, another's to 40-50): per layer, the median over the runs
            hits = {label: [int(statistics.median(h)) for h in zip(*got)] for label, got in each_hit.items()}
        else:
            for policy, label in runs:
                use(policy, label)
                engine = Runs(loaded, cfg.with_(n_batch=p or 512, n_ubatch=ub), p, n)
                engine.warm_up(0)
                before = backend.streamer.bytes_copied
                samples[label], hits[label] = engine.timed(reps)
                copied[label] += backend.streamer.bytes_copied - before
                n_runs[label] += reps
        for policy, label in runs:
            got, hit = samples[label], hits[label]
            avg = sum(got) / len(got)
            per_run = copied[label] / n_runs[label]
            row = {"samples_ts": got, "avg_ts": avg,
                   "stddev_ts": (sum((s - avg) ** 2 for s in got) / max(len(got) - 1, 1)) ** 0.5,
                   "experts_hit": hit, "copied_gb_per_run": per_run / 1e9,
                   "copied_gb_per_s": per_run * avg / (p + n) / 1e9,  # over the whole run, at its mean speed
                   "auto_choices": {size: (explorers[label].chosen.get(size), {k: min(v) * 1e3 for k, v in t.items() if v})
                                    for size, t in explorers[label].trials.items()} if policy == "auto" else {}}
            out.setdefault(name(p, n, ub), {})[label] = row
            print(f"ferry {label:9s} {name(p, n, ub):14s} {avg:9.2f} t/s  hit {min(hit) if hit else ''}-"
                  f"{max(hit) if hit else ''}  copied {row['copied_gb_per_run']:.1f} GB/run "
                  f"({row['copied_gb_per_s']:.1f} GB/s)  {row['auto_choices'] or ''}", file=sys.stderr, flush=True)
        best, vs = versus_best(out[name(p, n, ub)], interleave)
        if vs:
            print(f"ferry auto / {best} {name(p, n, ub)}: {vs.ratio:.3f} [{vs.ci_low:.3f}, {vs.ci_high:.3f}] "
                  f"({vs.verdict})", file=sys.stderr, flush=True)
        if partial:  # a call cut short keeps the tests it finished
            partial.write_text(json.dumps(out, indent=1))
    backend.close()
    return out


def versus_best(by_policy: dict, paired_runs: bool):
    """The best manual policy (by mean) and auto's comparison with it: from the pairs of interleaved runs, else
    from two independent samples (Welch); None where either is missing."""
    manual = {k: v["avg_ts"] for k, v in by_policy.items() if k != "auto" and not k.endswith("ubatch-first")}
    if not manual or "auto" not in by_policy:
        return None, None
    best = max(manual, key=manual.get)
    return best, (paired if paired_runs else welch)(by_policy[best]["samples_ts"], by_policy["auto"]["samples_ts"])


def llama_bench(exe: str, path: Path, threads: int, cases, reps: int) -> dict:
    base = [exe, "-m", str(path), "-ngl", "99", "-ot", "exps=CPU", "-fa", "1", "-lm", "none", "-t", str(threads),
            "-r", str(reps)]
    out = {}
    runs = [([*base, "-p", str(p), "-n", "0", "-b", str(p), "-ub", ",".join(str(ub) for q, _, ub in cases if q == p)])
            for p in sorted({p for p, _, _ in cases if p})]
    runs += [[*base, "-p", "0", "-n", str(n)] for n in sorted({n for _, n, _ in cases if n})]
    for cmd in runs:
        try:
            out |= {name(p, n, ub): stats for (p, n, ub), stats in llamacpp.llama_bench_rows(cmd).items()}
        except RuntimeError as e:  # one failed configuration does not lose the others
            print(e, file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", help="path of a CUDA llama-bench binary")
    ap.add_argument("--llama-bench-from", help="a file that will hold that path once a build finishes")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("--pp-big", type=int, default=4096)
    ap.add_argument("--ub-big", default="512,1024,2048,4096")
    ap.add_argument("--pp-small", type=int, default=512)
    ap.add_argument("--ub-small", default="64,128,256")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES), help="ferry's policies to measure (';'-separated "
                    "when one has commas)")
    ap.add_argument("--ubatch-first-policies", default="auto", help="policies also measured u-batch by u-batch "
                    "(','-separated; empty: none)")
    ap.add_argument("--all-cpu-big", action="store_true", help="also time all=off at the big prompt (slow)")
    ap.add_argument("--interleave", action="store_true", help="run the configs in turn, one run each, -r times over "
                    "on one engine, warmed up once under each; the order reversed every other turn; auto against the "
                    "best manual policy from the turns' pairs): for comparing configs that do the same work")
    ap.add_argument("--out", default="hybrid_vs_llamacpp.json")
    a = ap.parse_args()
    path = Path(a.model)
    cases = tests(a.pp_big, [int(v) for v in a.ub_big.split(",") if v], a.pp_small,
                  [int(v) for v in a.ub_small.split(",") if v], a.n)
    policies = a.policies.split(";") if ";" in a.policies else a.policies.split(",")
    ubatch_first = [p for p in a.ubatch_first_policies.split(",") if p]
    # ferry's part is kept if llama.cpp's fails, and test by test if the run is cut short
    fe = ferry_bench(path, a.threads, cases, a.r, policies, not a.all_cpu_big, ubatch_first, a.interleave,
                     Path(a.out).with_suffix(".ferry.json"))
    policies += [f"{p} ubatch-first" for p in ubatch_first]
    if a.llama_bench_from:
        a.llama_bench = llamacpp.wait_for_build(a.llama_bench_from)
    lc = llama_bench(a.llama_bench, path, a.threads, cases, a.r) if a.llama_bench else {}
    results = []
    build = ggml_build()  # ferry's CPU side: the features its ggml was compiled for
    for test, by_policy in fe.items():
        auto = by_policy.get("auto", {}).get("avg_ts")
        ref = lc.get(test)
        # interleaved runs are pairs (auto's i-th run beside best's i-th); otherwise two independent samples
        best, vs = versus_best(by_policy, a.interleave)
        results.append({"model": path.name, "test": test, "ferry": by_policy, "llama.cpp": ref, "ggml_build": build,
                        "ratio_auto": auto / ref["avg_ts"] if auto and ref else None,
                        "best_manual": best, "auto_vs_best_manual": vs.ratio if vs else None,
                        # the ratio's 95% interval and whether the difference is real at these repetitions
                        "auto_vs_best_ci": [vs.ci_low, vs.ci_high] if vs else None,
                        "auto_vs_best_verdict": vs.verdict if vs else None,
                        "auto_vs_best_statistics": ("paired" if a.interleave else "welch") if vs else None})
    Path(a.out).write_text(json.dumps(results, indent=1))
    print("| test | experts hit/layer | " + " | ".join(f"ferry {p} t/s" for p in policies)
          + " | llama.cpp t/s | auto / llama.cpp | auto / best manual [95% interval] |")
    print("| --- | --- | " + " | ".join("---:" for _ in policies) + " | ---: | ---: | ---: |")
    for r in results:
        cells = []
        for p in policies:
            v = r["ferry"].get(p)
            cells.append(f"{v['avg_ts']:.1f} ± {v['stddev_ts']:.1f}" if v else "")
        hits = next((v["experts_hit"] for v in r["ferry"].values() if v["experts_hit"]), [])
        hit = f"{min(hits)}-{max(hits)}" if hits else ""
        ref = r["llama.cpp"]
        lt = f"{ref['avg_ts']:.1f} ± {ref['stddev_ts']:.1f}" if ref else "not run"
        ra = f"{r['ratio_auto']:.2f}" if r["ratio_auto"] else ""
        rb = ""
        if r["auto_vs_best_manual"]:
            lo, hi = r["auto_vs_best_ci"]
            ci = f" [{lo:.2f}, {hi:.2f}]" if lo == lo else ""  # NaN below compare's minimum repetitions
            rb = f"{r['auto_vs_best_manual']:.2f}{ci} ({r['best_manual']}; {r['auto_vs_best_verdict']})"
        print(f"| {r['test']} | {hit} | " + " | ".join(cells) + f" | {lt} | {ra} | {rb} |")


if __name__ == "__main__":
    main()
