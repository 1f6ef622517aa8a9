#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install what is missing from the carried .whl folder (gguf;
# ggml-python built on the carried llama.cpp tree's ggml, for the CPU results the GPU is checked against),
# run the GPU tests (tests_gpu/: kernels against float64 references, the GPU forward against the CPU one) and
# the GPU benchmarks, and print a short summary.
#   carry .whl (gguf wheel, ggml-python sdist, llama.cpp-src.tar.gz, serve/: the server's wheels); results in $OUT
#   (default ./out)
#   STAGES (default "tests bench"): any of
#     tests   tests_gpu/ (kernels, model vs CPU); GPU_TESTS: which files, PYTEST_ARGS: more options (split at
#             spaces), PYTEST_K: a -k expression (spaces kept)
#     bench   ferry all-GPU on qwen3-moe-mid: pp512 and tg64, against the 16-thread CPU
#     big     ferry all-GPU on the qwen3-30b-a3b synthetic model: pp4096 at u-batch 128/512/2048/4096, tg128
#     hybrid  ferry with the experts in RAM (-ngl 999 -ot exps=CPU) on the same big model, every offload policy,
#             pp4096 at u-batch 512..4096, pp512 at 64..256, tg128 (HYBRID_ARGS: more options, split at spaces
#             without quote removal: write an empty value as --ub-big=)
#     kernels the grouped MoE GEMM and the generation GEMVs alone (benchmarks/moe_kernels.py, gemv_kernels.py):
#             default configurations and a sweep of them (KERNEL_ARGS: options of moe_kernels.py)
#     llama   the big runs through llama.cpp's CUDA llama-bench too (built here, sm_90, cached in .build/)
#     gemma   Gemma 3 270M on the GPU against float64, from the pieces scripts/gemma_pieces.py writes to .gemma/
#             (carried over back-to-back calls: the file is over one call's carry limit)
#     ab      the tree in .old (e.g. `git archive COMMIT ferry | tar -x -C .old`, carried) against this one on the big
#             model, processes in turn (benchmarks/ab_trees.py): experts in RAM (pp512 u-batch 128, tg128) and all on
#             the GPU (pp4096 u-batch 512, tg128); AB_ROUNDS processes per tree (default 2); AB_ARGS replaces the
#             experts-in-RAM run's sizes (default "-p 512 -ub 128 -n 128"), AB_PLACE its placement (default
#             "-ngl 999 -ot exps=CPU"; "--gpu-memory CUDA0=12GiB": the fit), AB_REPS its -r (default 3), AB_GPU=0 leaves
#             out the all-GPU one
#   small   a GPU smaller than the model (benchmarks/small_gpu.py): a ballast process leaves SMALL_CAPS GiB (default 12)
#           on CUDA0; ferry's default fit against its placements by hand and llama.cpp's -fitt fit (with the llama stage);
#           SMALL_ROUTING=0 leaves out the second default, after counting routing
#           SKEW=S adds the same preset written with `--routing-skew S`; every model's default runs again after
#           `ferry calibrate --routing` counted it on the repository's docs (the per-expert fit); SKEW_ONLY=1: that
#           model alone; KM=1 adds the preset with Q4_K_M experts (llama.cpp's mix); with the ik stage (or its build from an earlier call), ik_llama.cpp's fit and --n-cpu-moe
#           sweep too (waited for after ferry's and llama.cpp's runs)
#   ik      start ik_llama.cpp's CUDA build (.whl/ik_llama.cpp-*.tar.gz, ../shared/anchors) in the background with setsid,
#           into .build/ik; it outlives the call (about 13 minutes): a later call, while the machine is warm, uses it;
#           IK_CPU=1: its CPU build instead (for the cpu stage, a few minutes: one call can build and use it)
#   cpu     CPU only, GPU hidden: ferry against ik_llama.cpp -rtr 1 (benchmarks/cpu_vs_ik.py) on the big model at
#           CPU_THREADS (default 16), pp512 / pp2048 / tg64; waits for the ik build (CPU_ARGS: more options)
#   dsa     DeepSeek sparse attention with depth (benchmarks/dsa_depth.py) on PRESET (a deepseek32 / glm-dsa one):
#           all on the GPU (DSA_GPU=0 leaves it out), then with DSA_HYBRID=1 the experts in RAM too; DSA_ARGS: its options (default
#           "-d 4096,32768 -p 512 -n 32 -r 2"); with the llama stage, llama.cpp's too
#   sweep   `ferry sweep` beside llama.cpp at the same depths (benchmarks/sweep_vs_llamacpp.py) on PRESET, with the
#           plot: SWEEP_PLACEMENT (gpu, hybrid or cpu; default gpu), SWEEP_ARGS (default "-c 32768 -ub 512 --every 8");
#           with the llama stage, llama.cpp's llama-bench at every --every-th depth
#   PRESET (default qwen3-30b-a3b): the synthetic model of big / hybrid / llama, e.g. deepseek-v2-lite; SYNTH_ARGS:
#   more options of its `ferry synth` (e.g. PRESET=gpt-oss-20b SYNTH_ARGS="--expert-type mxfp4")
set -euo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests bench}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/gguf-*.whl
# the transformers ferry is tested with, where carried (the machine's 5.17 builds no tokenizer for some families)
if ls .whl/transformers-*.whl > /dev/null 2>&1 && [ ! -d /tmp/site/transformers ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/transformers-*.whl .whl/tokenizers-*.whl
fi
# the server's (tests_gpu/test_server_gpu.py), where the machine lacks them: .whl/serve holds fastapi, uvicorn and theirs
if [ -d .whl/serve ] && ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --find-links .whl/serve --target /tmp/site fastapi uvicorn \
        starlette annotated-doc annotated-types anyio h11 typing-inspection click sniffio pydantic pydantic_core \
        opentelemetry-api
fi
export FERRY_CACHE=$PWD/.build/ferry-cache
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has llama; then  # the CUDA build takes minutes: start it first
    # niced, so that ferry's own runs meanwhile keep their CPU (its launches are single-threaded)
    (nice -n 19 python3 benchmarks/llamacpp.py build .whl/llama.cpp-src.tar.gz --cuda \
        --cmake-arg=-DCMAKE_CUDA_ARCHITECTURES=90 --cmake-arg=-DGGML_NATIVE=ON > "$OUT/llama_bench_path.tmp" \
        2> "$OUT/llama_cpp_build.log" && mv "$OUT/llama_bench_path.tmp" "$OUT/llama_bench_path.txt" \
        || echo failed > "$OUT/llama_bench_path.txt") &
    BUILD=$!
fi
IK_PATH=$PWD/.build/ik_bench_path.txt
IK_CUDA="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"
if [ -n "${IK_CPU:-}" ]; then  # its CPU build alone (a few minutes on 16 cores): the cpu stage needs no more
    IK_PATH=$PWD/.build/ik_cpu_bench_path.txt; IK_CUDA="-DGGML_CUDA=OFF"
fi
if has ik && [ ! -f "$IK_PATH" ]; then
    rm -rf .build/ik && mkdir -p .build/ik && tar xzf .whl/ik_llama.cpp-*.tar.gz -C .build/ik --strip-components=1
    setsid nohup bash -c "cd .build/ik && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        $IK_CUDA -DGGML_SCHED_MAX_COPIES=1 -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF > ../ik_build.log 2>&1 && nice -n 10 cmake --build build -j 16 --target llama-bench \
        >> ../ik_build.log 2>&1 && echo $PWD/.build/ik/build/bin/llama-bench > $IK_PATH.tmp \
        && mv $IK_PATH.tmp $IK_PATH || echo failed > $IK_PATH" > /dev/null 2>&1 < /dev/null &
fi
# ferry's timed runs wait for the build: compiling on every core beside them cost hybrid generation a third of
# its speed (25.7 against 37.7 t/s, docs/performance.md 2026-11-23), while llama.cpp's runs came after the build
wait_build() { if [ -n "${BUILD:-}" ]; then wait "$BUILD" || true; BUILD=; fi; }
PRESET=${PRESET:-qwen3-30b-a3b}
BIG=/tmp/$PRESET.gguf
if has big || has llama || has hybrid || has ab || has cpu || has dsa || has sweep || { has small && [ -z "${SKEW_ONLY:-}" ]; }; then
    [ -f "$BIG" ] || python3 -m ferry synth "$PRESET" ${SYNTH_ARGS:-} -o "$BIG" -q &
    SYNTH=$!
fi
wait_synth() { if [ -n "${SYNTH:-}" ]; then wait "$SYNTH"; SYNTH=; fi; }
# ggml-python built -march=native, as the llama stage builds llama.cpp (GGML_NATIVE=ON): the same build for both
# engines. On this machine's Xeon native is the faster one for both (CPU-only tg64 30.3 against 25.3 t/s with the
# explicit flags that benchmarks/llamacpp.py picks by default; docs/decisions.md, "ggml-python on the GPU machine
# built -march=native")
python3 -c "import ggml" 2>/dev/null || CMAKE_ARGS="${FERRY_GGML_CMAKE_ARGS:--DGGML_NATIVE=ON}" \
    python3 benchmarks/llamacpp.py ggml-python .whl/ggml_python-*.tar.gz \
    .whl/llama.cpp-src.tar.gz > "$OUT/ggml_python_build.log" 2>&1 || { tail -20 "$OUT/ggml_python_build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "from ferry.offload.calibrate import ggml_build; print('ggml built for', *ggml_build())" | tee -a "$OUT/gpu.txt"
if has tests; then
    # the two-GPU test needs two GPUs: on one it is left out, not skipped
    ONE_GPU=""; [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || ONE_GPU="--ignore=tests_gpu/test_two_gpus.py"
    python3 -m pytest -q -s ${GPU_TESTS:-tests_gpu} $ONE_GPU -p no:cacheprovider ${PYTEST_ARGS:-} \
        ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
        | tee "$OUT/tests_gpu.txt" | grep -E "KL|passed|failed|Error|error" | tail -40 || true
fi
if has gemma; then
    cat .gemma/p? > /tmp/gemma.gguf && sha256sum /tmp/gemma.gguf | tee "$OUT/gemma_sha256.txt"
    FERRY_GEMMA_GGUF=/tmp/gemma.gguf python3 -m pytest -q -s tests_gpu/test_model_gpu.py -k gemma -p no:cacheprovider \
        2>&1 | tee "$OUT/gemma_gpu.txt" | grep -E "KL|passed|failed|Error" || true
fi
if has kernels; then
    wait_build
    python3 benchmarks/moe_kernels.py --json "$OUT/moe_kernels.json" ${KERNEL_ARGS:-} | tee "$OUT/moe_kernels.md"
    python3 benchmarks/gemv_kernels.py --json "$OUT/gemv_kernels.json" | tee "$OUT/gemv_kernels.md"
fi
if has bench; then
    wait_build
    python3 -m ferry synth qwen3-moe-mid -o /tmp/mid.gguf -q
    python3 -m ferry bench -m /tmp/mid.gguf -ngl 999 -p 512 -n 64 -r 3 | tee "$OUT/bench_gpu_mid.md"
    python3 -m ferry bench -m /tmp/mid.gguf -ngl 0 -t 16 -p 512 -n 64 -r 3 | tail -2 | tee -a "$OUT/bench_gpu_mid.md"
fi
LB=""
if has llama; then LB="--llama-bench-from $OUT/llama_bench_path.txt"; fi
if has hybrid; then
    wait_synth
    wait_build
    python3 benchmarks/hybrid_vs_llamacpp.py $LB -m "$BIG" -t 16 ${HYBRID_ARGS:-} \
        --out "$OUT/hybrid_vs_llamacpp.json" | tee "$OUT/hybrid_vs_llamacpp.md"
fi
if has big; then
    wait_synth
    wait_build
    python3 benchmarks/gpu_vs_llamacpp.py $LB -m "$BIG" ${BIG_ARGS:-} --out "$OUT/gpu_vs_llamacpp.json" \
        | tee "$OUT/gpu_vs_llamacpp.md"
fi
if has dsa; then
    wait_synth
    wait_build
    [ "${DSA_GPU:-1}" = 1 ] && python3 benchmarks/dsa_depth.py $LB -m "$BIG" ${DSA_ARGS:--d 4096,32768 -p 512 -n 32 -r 2} \
        --out "$OUT/dsa_depth_gpu.json" 2> "$OUT/dsa_depth_gpu.log" | tee "$OUT/dsa_depth_gpu.md"
    [ "${DSA_HYBRID:-0}" = 1 ] && python3 benchmarks/dsa_depth.py $LB -m "$BIG" --hybrid \
        ${DSA_ARGS:--d 4096,32768 -p 512 -n 32 -r 2} --out "$OUT/dsa_depth_hybrid.json" 2> "$OUT/dsa_depth_hybrid.log" \
        | tee "$OUT/dsa_depth_hybrid.md"
fi
if has sweep; then
    wait_synth
    wait_build
    python3 benchmarks/sweep_vs_llamacpp.py $LB -m "$BIG" --placement "${SWEEP_PLACEMENT:-gpu}" -t 16 \
        ${SWEEP_ARGS:--c 32768 -ub 512 --every 8} --out "$OUT/sweep.json" --plot "$OUT/sweep.png" \
        2> "$OUT/sweep.log" | tee "$OUT/sweep.md"
fi
if has ab; then
    wait_synth
    wait_build
    python3 benchmarks/ab_trees.py --a .old --b . --rounds "${AB_ROUNDS:-2}" --json "$OUT/ab_hybrid.json" -- \
        -m "$BIG" ${AB_PLACE:--ngl 999 -ot exps=CPU} -t 16 ${AB_ARGS:--p 512 -ub 128 -n 128} -r ${AB_REPS:-3} 2> "$OUT/ab_hybrid.log" \
        | tee "$OUT/ab_hybrid.md"
    if [ "${AB_GPU:-1}" = 1 ]; then
        python3 benchmarks/ab_trees.py --a .old --b . --rounds "${AB_ROUNDS:-2}" --json "$OUT/ab_gpu.json" -- \
            -m "$BIG" -ngl 999 -t 16 -p 4096 -ub 512 -n 128 -r ${AB_REPS:-3} 2> "$OUT/ab_gpu.log" | tee "$OUT/ab_gpu.md"
    fi
fi
if has cpu; then
    wait_synth
    wait_build
    IK=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import llamacpp; print(llamacpp.wait_for_build('$IK_PATH') or '')")
    [ -n "$IK" ] || { tail -20 .build/ik_build.log; exit 1; }
    { lscpu | grep -i "model name"; grep -o -w "amx_int8\|avx512_vnni" /proc/cpuinfo | sort | uniq -c
      python3 -c "from ferry.kernels.cpu import native; print('ferry CPU kernels:', native.kernel_id())"; } \
        | tee "$OUT/cpu.txt"
    CUDA_VISIBLE_DEVICES= python3 benchmarks/cpu_vs_ik.py --ik "$IK" -m "$BIG" -t "${CPU_THREADS:-16}" ${CPU_ARGS:-} \
        --out "$OUT/cpu_vs_ik.json" 2> "$OUT/cpu_vs_ik.log" | tee "$OUT/cpu_vs_ik.md"
    # ferry on ggml's kernels alone, for the change ferry's own made
    CUDA_VISIBLE_DEVICES= FERRY_NATIVE=0 python3 -m ferry bench -m "$BIG" -ngl 0 -t "${CPU_THREADS:-16}" -p 512 -n 64 \
        -r 2 | tail -2 | tee "$OUT/cpu_ggml_only.md"
fi
if has small; then
    wait_synth
    MODELS=(); [ -n "${SKEW_ONLY:-}" ] || MODELS=(-m "$BIG")
    if [ -n "${SKEW:-}" ]; then
        SKEWED=/tmp/$PRESET-skew$SKEW.gguf
        [ -f "$SKEWED" ] || python3 -m ferry synth "$PRESET" --routing-skew "$SKEW" -o "$SKEWED" -q
        MODELS+=(-m "$SKEWED")
    fi
    if [ -n "${KM:-}" ]; then  # the same preset with llama.cpp's Q4_K_M mix of expert types
        KMF=/tmp/$PRESET-q4km.gguf
        [ -f "$KMF" ] || python3 -m ferry synth "$PRESET" --expert-type q4_k_m -o "$KMF" -q
        MODELS+=(-m "$KMF")
    fi
    cat README.md docs/*.md > /tmp/routing-all.txt; head -c 60000 /tmp/routing-all.txt > /tmp/routing.txt
    wait_build
    ROUTING="--routing-text /tmp/routing.txt"; [ "${SMALL_ROUTING:-1}" = 1 ] || ROUTING=""
    IKB=""; if has ik || [ -f "$IK_PATH" ]; then IKB="--ik-bench-from $IK_PATH"; fi
    python3 benchmarks/small_gpu.py $LB $IKB "${MODELS[@]}" --caps "${SMALL_CAPS:-12}" -t 16 $ROUTING \
        ${SMALL_ARGS:-} --out "$OUT/small_gpu.json" 2> "$OUT/small_gpu.log" | tee "$OUT/small_gpu.md"
fi
wait_build  # a build started for later calls finishes in this one (kept in .build/ while the machine is warm)
