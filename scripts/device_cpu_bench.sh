#!/usr/bin/env bash
# The CPU benchmark on the GPU machine's 16-core CPU (issue 3's target (b)), in one call of the device tool:
#   carry .whl (gguf wheel, ggml-python sdist, llama.cpp-src.tar.gz from `benchmarks/llamacpp.py strip`)
# installs gguf, builds ggml-python on the carried llama.cpp tree's ggml and llama-bench from the same tree
# (-march=native, both), writes the qwen3-30b-a3b synthetic model and runs ferry and llama-bench side by side.
# Env: THREADS (16), PROMPT (512), GEN (64), REPS (3); LLAMA_NATIVE=1 builds llama.cpp with -march=native
# (AMX included) instead of this CPU's explicit flags, FERRY_NATIVE=1 likewise for ggml-python;
# results in $OUT (default ./out).
set -euo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
THREADS=${THREADS:-16}; PROMPT=${PROMPT:-512}; GEN=${GEN:-64}; REPS=${REPS:-3}
export FERRY_CACHE=/tmp/ferry-cache PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/gguf-*.whl
t0=$(date +%s)
if [ "${FERRY_NATIVE:-0}" = 1 ]; then export CMAKE_ARGS=-DGGML_NATIVE=ON; fi
python3 benchmarks/llamacpp.py ggml-python .whl/ggml_python-*.tar.gz .whl/llama.cpp-src.tar.gz > "$OUT/ggml_python_build.log" 2>&1 &
p1=$!
unset CMAKE_ARGS
FLAGS=""; SUFFIX=""
if [ "${LLAMA_NATIVE:-0}" = 1 ]; then FLAGS="--cmake-arg=-DGGML_NATIVE=ON"; SUFFIX="_llama-native"; fi
if [ "${FERRY_NATIVE:-0}" = 1 ]; then SUFFIX="${SUFFIX}_ferry-native"; fi
python3 benchmarks/llamacpp.py build .whl/llama.cpp-src.tar.gz $FLAGS > "$OUT/llama_bench_path.txt" 2> "$OUT/llama_cpp_build.log" &
p2=$!
python3 -m ferry synth qwen3-30b-a3b -o /tmp/qwen3-30b-a3b.gguf -q &
p3=$!
wait $p1 || { tail -20 "$OUT/ggml_python_build.log"; exit 1; }
wait $p2 || { tail -20 "$OUT/llama_cpp_build.log"; exit 1; }
wait $p3
echo "builds and synth: $(( $(date +%s) - t0 )) s"
lscpu | grep -E "Model name|^CPU\(s\)|L3|Flags" > "$OUT/cpu.txt"; grep -E "Model name|^CPU\(s\)|L3" "$OUT/cpu.txt"
python3 benchmarks/cpu_vs_llamacpp.py --llama-bench "$(cat "$OUT/llama_bench_path.txt")" -m /tmp/qwen3-30b-a3b.gguf \
    -t "$THREADS" -p "$PROMPT" -n "$GEN" -r "$REPS" --out "$OUT/cpu_vs_llamacpp_t$THREADS$SUFFIX.json" | tee "$OUT/cpu_vs_llamacpp_t$THREADS$SUFFIX.md"
