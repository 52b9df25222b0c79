#!/usr/bin/env bash
# The GPU checks, one device session: build te_jax (offline, with the cuDNN engine), precompile its kernels, then run
# the sections asked for (default: tests sanitize jit bench), logging under $OUT (default /tmp/te_jax_out):
#   smoke       scripts/gpu_smoke.py: te_jax's forward on long sequences against a float32 XLA reference
#   tests       the CUDA tests
#   packed      the packed-sequence tests, then the harness's packed preset
#   bias        the additive bias's tests
#   features    the harness's features preset: sinks, bias and dropout against plain attention
#   flex        score_mod / mask_mod: their GPU tests, then the harness's mod rows against the built-in and cuDNN
#   fp8         the FP8 KV cache's decode kernels: their tests and the decode tests,
#               memcheck and racecheck, then FP8 rows beside bf16's, cuDNN's and the K/V read alone
#   fp8attn     FP8 q, k and v in the sm90 FP8 forward: its tests, memcheck and racecheck, then its forward beside bf16's
#               and cuDNN's FP8 and bf16 forwards
#   train       examples/train_lm.py, a short run per attention
#   stress      the kernel tests with a random sleep before every pipeline wait
#   sanitize    compute-sanitizer (memcheck, racecheck) on scripts/cuda_sanitize_case.py, section by section
#   jit         compile times into an empty cache, then a fresh process's compile with every kernel in it
#   decode      the harness's decode preset beside kv-read (the bandwidth ceiling), and the crossover in query positions
#   ab          the harness on the installed kernels and on other trees' (--kernel-root), alternating processes
#   cp_overlap  the context-parallel ring against one GPU, and its permutes alone (several GPUs)
#   bench       the harness's fa preset: te_jax's engines against JAX's cuDNN
#   peers       the d 128 forward and forward + backward beside tokamax (Mosaic, Triton) and cuDNN's FP8 forward
#   ncu         Nsight Compute on one step of te_jax's kernels and of cuDNN's (scripts/profile_step.py), per NCU_CASES
# Usage: OUT=DIR bash scripts/gpu_check.sh [SECTION]...; each section's variables are described at the section.
# TE_JAX_CACHE_DIR defaults to ./.jitcache (carry a precompiled cache there to skip NVRTC). The cuDNN frontend's
# headers (not on the GPU machine) come from $CUDNN_FRONTEND_INCLUDE_DIR, default build/cudnn_check/fe/include (carry
# it).
set -u -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/te_jax_out}
mkdir -p "$OUT"
export TE_JAX_CACHE_DIR=${TE_JAX_CACHE_DIR:-$REPO/.jitcache}
SECTIONS=${*:-tests sanitize jit bench}
for s in $SECTIONS; do
  case " smoke tests packed bias features flex fp8 fp8attn train stress sanitize jit decode ab cp_overlap bench peers ncu " in
  *" $s "*) ;;
  *) echo "unknown section '$s'; the sections are listed at the top of $0"; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"

# compute-sanitizer's memcheck and racecheck on one section of scripts/cuda_sanitize_case.py, a process each (a crash of
# the tool costs that report alone), a line per tool.
sanitize_case() {
  local cs log t0
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    log="$OUT/sanitize_${tool}_$1.log"
    timeout 150 "$cs" --tool $tool --kernel-name kns=te_jax_ --print-limit 20 python3 \
      "$REPO/scripts/cuda_sanitize_case.py" --sections "$1" > "$log" 2>&1
    echo "sanitizer $tool $1 rc=$? ($(( $(date +%s) - t0 )) s): $(grep -E \
      'ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid|as expected' "$log" | head -3 | tr '\n' ' ')"
  done
}

export CUDNN_FRONTEND_INCLUDE_DIR=${CUDNN_FRONTEND_INCLUDE_DIR:-$REPO/build/cudnn_check/fe/include}
t0=$(date +%s)
(cd "$REPO" && python3 -m pip install -q --no-build-isolation --no-deps . ) > "$OUT/build.log" 2>&1 \
  || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
cd /tmp  # import the installed package, not the source tree

# AOT_SETS: the configuration sets precompiled first (te_jax.aot --set); empty: none (kernels compile as calls need them).
if [ -n "${AOT_SETS-tests,bench}" ]; then
  t0=$(date +%s)
  python3 -m te_jax.aot --set "${AOT_SETS-tests,bench}" --jobs 16 > "$OUT/aot.log" 2>&1; tail -1 "$OUT/aot.log"
  echo "aot precompile: $(( $(date +%s) - t0 )) s"
fi
# te_jax's kernels and its cuDNN engine proven by running them (or why not), beside JAX's cuDNN.
python3 -m te_jax.bench --list-backends --backends te_jax-te,te_jax-cudnn,jax-cudnn 2>&1 | grep -v Warning

for s in $SECTIONS; do
  case $s in
  smoke)
    timeout ${SMOKE_TIMEOUT:-180} python3 "$REPO/scripts/gpu_smoke.py" 2>&1 | tee "$OUT/smoke.log" | grep -v Warning
    echo "smoke rc=$?" ;;
  tests)
    t0=$(date +%s)
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -rA -n ${TEST_WORKERS:-4} \
      "$REPO"/tests/test_cuda_attention.py "$REPO"/tests/test_cuda_decode.py "$REPO"/tests/test_cuda_packed.py \
      "$REPO"/tests/test_cuda_dropout.py "$REPO"/tests/test_cuda_bias.py "$REPO"/tests/test_cuda_sinks.py \
      "$REPO"/tests/test_cuda_drop_in.py 2>&1 \
      | tee "$OUT/tests.log" | grep -E "passed|failed|FAILED|^E  " | tail -60
    echo "tests: $(( $(date +%s) - t0 )) s" ;;
  packed)
    # Packed sequences: the GPU tests with the token kernels alone (TE_JAX_SM90_DOCUMENTS=0) and with the forward's
    # document kernel alone (=forward; the tests section runs the default, both directions'), then the harness's packed
    # preset under PACKED_DOCUMENTS (default all): rows of 2, 8 and 32 documents against their batch (and cuDNN's
    # batch), the ids rising (read as documents) and falling (the token tables).
    t0=$(date +%s)
    for mode in 0 forward; do
      TE_JAX_SM90_DOCUMENTS=$mode timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -rA \
        -n ${TEST_WORKERS:-4} "$REPO"/tests/test_cuda_packed.py 2>&1 | tee "$OUT/packed_tests_$mode.log" \
        | grep -E "passed|failed|FAILED|^E  " | tail -40
      echo "packed tests (documents: $mode): $(( $(date +%s) - t0 )) s"
    done
    TE_JAX_SM90_DOCUMENTS=${PACKED_DOCUMENTS:-all} timeout ${BENCH_TIMEOUT:-300} python3 -m te_jax.bench \
      --preset packed --backends ${PACKED_BACKENDS:-te_jax-te,te_jax-packed,te_jax-unsorted-packed,jax-cudnn} \
      --baseline te_jax-te --keep-going --budget ${BENCH_BUDGET:-250} \
      --json "$OUT/packed.json" 2>&1 | tee "$OUT/packed.log" | grep -v Warning | tail -40 ;;
  train)
    # examples/train_lm.py at --size gpu, a short run per attention. Flax and optax are not on the GPU
    # machine: their wheels (and their pure-Python dependencies) are carried in $WHEELS (default .device_out/wheels).
    PYDEPS=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-index --target "$PYDEPS" "${WHEELS:-$REPO/.device_out/wheels}"/*.whl \
      > "$OUT/train_deps.log" 2>&1 || { echo "train: wheels did not install"; tail -5 "$OUT/train_deps.log"; }
    for run in "te_jax --packing documents" "te_jax --packing rows" "jax-cudnn --packing rows" "jax --packing documents"; do
      log="$OUT/train_${run%% *}_${run##* }.log"
      PYTHONPATH="$PYDEPS" timeout 240 python3 "$REPO/examples/train_lm.py" --size gpu --steps ${TRAIN_STEPS:-60} \
        --no-progress --plot "${log%.log}.png" --attention $run > "$log" 2>&1
      echo "train $run: rc=$?"; grep -E "^(train_lm|summary)" "$log" || tail -4 "$log"
    done ;;
  features)
    # What sinks, a bias ([1, H, S, S] and [B, 1, 1, S]) and dropout cost over plain attention, cuDNN beside for the bias.
    timeout ${BENCH_TIMEOUT:-500} python3 -m te_jax.bench --preset features --backends te_jax-te,jax-cudnn --keep-going \
      --json "$OUT/features.json" 2>&1 | tee "$OUT/features.log" | grep -v Warning | tail -40 ;;
  flex)
    # score_mod / mask_mod compiled into the kernels: their GPU tests (forward, gradients, captures, block masks, shard
    # offsets, d 256), then a causal mask_mod with and without its block mask and a table score_mod against the
    # built-in causal mask and cuDNN at FLEX_SEQS.
    t0=$(date +%s)
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -rA -n ${TEST_WORKERS:-4} \
      "$REPO"/tests/test_cuda_flex.py 2>&1 | tee "$OUT/flex_tests.log" | grep -E "passed|failed|FAILED|^E  " | tail -40
    echo "flex tests: $(( $(date +%s) - t0 )) s"
    timeout ${BENCH_TIMEOUT:-300} python3 -m te_jax.bench --preset fa --head-dim 128 --causal --seq ${FLEX_SEQS:-2048,8192} \
      --backends te_jax-te,te_jax-mask-mod,te_jax-block-mask,te_jax-score-mod,jax-cudnn --baseline te_jax-te \
      --keep-going --json "$OUT/flex.json" 2>&1 | tee "$OUT/flex.log" | grep -v Warning | tail -40 ;;
  fp8)
    # The FP8 KV cache's decode kernels: their tests beside the bf16 decode's, the sanitizers on scripts/cuda_sanitize_case.py's fp8
    # section, then FP8_SHAPES (batch_keys_queries; default one query over b 8 x 32k, b 64 x 4k and b 8 x 128k, 16
    # over b 8 x 8k; h 32 / kv 8, d 128, no mask) in both caches. FP8_STEPS picks among those three (default: tests
    # sanitize bench), to split them over calls; FP8_BACKENDS the harness's rows (default: te, paged64, fp8-cache,
    # fp8-paged64, cuDNN and the K/V read alone; te_jax-fp8-perhead-paged64 pages with the contiguous row's descales).
    steps=" ${FP8_STEPS:-tests sanitize bench} "
    t0=$(date +%s)
    [[ $steps == *" tests "* ]] && timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rA \
      -n ${TEST_WORKERS:-4} "$REPO"/tests/test_cuda_fp8_decode.py "$REPO"/tests/test_cuda_decode.py 2>&1 | tee "$OUT/fp8_tests.log" \
      | grep -E "passed|failed|FAILED|^E  " | tail -40
    [[ $steps == *" tests "* ]] && echo "fp8 tests: $(( $(date +%s) - t0 )) s"
    [[ $steps == *" sanitize "* ]] && sanitize_case fp8
    for shape in $([[ $steps == *" bench "* ]] && echo ${FP8_SHAPES:-8_32768_1 64_4096_1 8_131072_1 8_8192_16}); do
      IFS=_ read -r batch keys queries <<< "$shape"
      timeout ${BENCH_TIMEOUT:-120} python3 -m te_jax.bench --mode fwd --batch $batch --heads 32 --kv-heads 8 \
        --head-dim 128 --seq $queries --seq-kv $keys --causal no --keep-going \
        --backends ${FP8_BACKENDS:-te_jax-te,te_jax-paged64,te_jax-fp8-cache,te_jax-fp8-paged64,jax-cudnn,kv-read} \
        --json "$OUT/fp8_$shape.json" 2>&1 | tee "$OUT/fp8_$shape.log" | grep -v Warning | grep "│\|unavailable" | tail -12
    done
    ;;
  fp8attn)
    # FP8 q, k and v in the sm90 FP8 forward, reached through TE_JAX_CUDA_FP8_ATTENTION=1 (te_jax/fp8.py): its GPU
    # tests, the sanitizers on scripts/cuda_sanitize_case.py's fp8attn section, then the d 128 forward at FP8ATTN_SEQS
    # (default 2048,8192; causal and not) beside te_jax's bf16 and cuDNN's FP8 and bf16 forwards, each with its error
    # against the float64 reference. FP8ATTN_STEPS picks among tests, sanitize and bench (default: all three).
    export TE_JAX_CUDA_FP8_ATTENTION=1
    steps=" ${FP8ATTN_STEPS:-tests sanitize bench} "
    t0=$(date +%s)
    [[ $steps == *" tests "* ]] && timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rA \
      -n ${TEST_WORKERS:-4} "$REPO"/tests/test_cuda_fp8_attention.py 2>&1 | tee "$OUT/fp8attn_tests.log" \
      | grep -E "passed|failed|FAILED|^E  " | tail -40
    [[ $steps == *" tests "* ]] && echo "fp8attn tests: $(( $(date +%s) - t0 )) s"
    [[ $steps == *" sanitize "* ]] && sanitize_case fp8attn
    [[ $steps == *" bench "* ]] && timeout ${BENCH_TIMEOUT:-300} python3 -m te_jax.bench --preset fa --head-dim 128 \
      --mode fwd --seq ${FP8ATTN_SEQS:-2048,8192} --causal both --keep-going --baseline jax-fp8-cudnn \
      --backends te_jax-te,te_jax-fp8-qkv,jax-fp8-cudnn,jax-cudnn --json "$OUT/fp8attn.json" 2>&1 \
      | tee "$OUT/fp8attn.log" | grep -v Warning | tail -30
    unset TE_JAX_CUDA_FP8_ATTENTION ;;
  bias)
    # The additive bias: its GPU tests, and the GPU refusal of deterministic=True with a summed dbias.
    t0=$(date +%s)
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -rA -n ${TEST_WORKERS:-4} \
      "$REPO"/tests/test_cuda_bias.py \
      "$REPO"/tests/test_bias.py::test_cuda_refuses_deterministic_with_a_summed_dbias_at_lowering 2>&1 \
      | tee "$OUT/bias_tests.log" \
      | grep -E "passed|failed|FAILED|^E  " | tail -40
    echo "bias tests: $(( $(date +%s) - t0 )) s" ;;
  stress)
    # The numerics tests of te_jax's kernels with a random sleep before every pipeline wait and hand-over
    # (kernels/primitives/mbarrier.h), STRESS_ROUNDS times: a missing wait shows up as a wrong result.
    for round in $(seq ${STRESS_ROUNDS:-2}); do
      t0=$(date +%s)
      TE_JAX_PIPELINE_STRESS=1 timeout ${STRESS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -n ${TEST_WORKERS:-4} \
        "$REPO"/tests/test_cuda_attention.py -k "not cudnn and not auto and not cached" 2>&1 | tee "$OUT/stress_$round.log" \
        | grep -E "passed|failed|FAILED" | tail -8
      echo "stress round $round: $(( $(date +%s) - t0 )) s"
    done ;;
  sanitize)
    # The sections of the case (SANITIZE_SECTIONS) one by one.
    for section in ${SANITIZE_SECTIONS:-variants nonfinite persistent decode paged bias packed}; do
      sanitize_case $section
    done ;;
  jit)
    # Compile time per configuration into an empty cache; then, in a fresh process with every kernel in that cache, the
    # import and the lowering + compile of a forward and of a forward + backward (te_jax's debug log names where each
    # kernel came from and how long it took to read).
    FRESH=$(mktemp -d)
    TE_JAX_CACHE_DIR=$FRESH python3 -m te_jax.aot --set bench --arch sm_90a --jobs 1 2>&1 | tee "$OUT/jit.log" | tail -7
    TE_JAX_CACHE_DIR=$FRESH TE_JAX_LOG_LEVEL=DEBUG python3 - <<'PY' 2>&1 | tee -a "$OUT/jit.log"
import time; t = time.perf_counter()
import jax, jax.numpy as jnp, te_jax
t_import = time.perf_counter() - t
jax.devices()
x = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
attn = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", scale=0.1, engine="te")
step = jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
seconds = {}
for name, fn in (("forward", attn), ("forward + backward", step)):
  t = time.perf_counter(); jax.jit(fn).lower(x, x, x).compile(); seconds[name] = time.perf_counter() - t
print(f"fresh process, kernels in the cache: import {t_import * 1e3:.0f} ms; lower + compile "
      + ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in seconds.items()))
PY
    ;;
  decode)
    # Decode (bf16 and FP8 caches, contiguous and paged) against cuDNN and XLA, beside the K/V read alone (kv-read: the
    # bandwidth ceiling of these memory-bound shapes), then the forward's crossover in query positions at 8k keys.
    timeout ${BENCH_TIMEOUT:-300} python3 -m te_jax.bench --preset decode --keep-going --json "$OUT/decode.json" \
      --backends te_jax-te,te_jax-paged64,te_jax-fp8-cache,te_jax-fp8-paged64,jax-cudnn,jax-xla,kv-read 2>&1 \
      | tee "$OUT/decode.log" | grep -v Warning | tail -30
    timeout ${BENCH_TIMEOUT:-300} python3 -m te_jax.bench --backends te_jax-te,jax-cudnn --mode fwd --batch 8 --heads 32 \
      --kv-heads 8 --head-dim 128 --seq 1,4,16,17,32,64 --seq-kv 8192 --causal no --keep-going \
      --json "$OUT/decode_crossover.json" 2>&1 | tee "$OUT/decode_crossover.log" | grep -v Warning | tail -20 ;;
  ab)
    # A before/after of kernel trees: the harness on the installed tree's kernels and on each of AB_ROOTS
    # ("label=DIR ...", each DIR holding a tree's cpp/, carried; e.g. `git archive <commit> cpp | tar -x -C DIR`)
    # through --kernel-root, one process per tree and round, alternating, AB_ROUNDS rounds (default 2), each writing
    # $OUT/ab_<label>_<round>.json. AB_ARGS are the harness's flags (default: the decode preset, te_jax-te,
    # te_jax-paged64 and jax-cudnn; e.g. "--preset fa --backends te_jax-te --mode fwd --seq 4096" for the forward).
    AB_ARGS=${AB_ARGS:-"--preset decode --backends te_jax-te,te_jax-paged64,jax-cudnn"}
    for round in $(seq ${AB_ROUNDS:-2}); do
      for tree in installed ${AB_ROOTS:-}; do
        root=${tree#*=}; [ "$tree" = installed ] && root=""
        timeout ${AB_TIMEOUT:-300} python3 -m te_jax.bench $AB_ARGS ${root:+--kernel-root "$root"} --keep-going -q \
          --json "$OUT/ab_${tree%%=*}_$round.json" 2>&1 | grep -v Warning | tail -40
      done
    done ;;
  cp_overlap)
    # Context parallelism on a multi-GPU machine: the ring over CP_DEVICES GPUs (default all) against one GPU, and its
    # K/V permutes alone; the ring's exposed communication is ring - one / N, read against the permutes' time.
    timeout ${BENCH_TIMEOUT:-500} python3 -m te_jax.bench --backends te_jax-ffi,te_jax-cp-ring,cp-ring-permutes \
      --baseline te_jax-ffi ${CP_DEVICES:+--cp-devices $CP_DEVICES} --batch 1 --seq ${CP_SEQS:-32768,131072,262144} \
      --heads 32 --kv-heads 8 --head-dim 128 --causal --mode fwd --keep-going --json "$OUT/cp_overlap.json" 2>&1 \
      | tee "$OUT/cp_overlap.log" | grep -v Warning | tail -30 ;;
  peers)
    # tokamax is not on the GPU machine: its wheels and their pure-Python dependencies (tokamax, einshape, pydantic,
    # pydantic-core (cp312), annotated-types, typing-inspection, qwix, immutabledict, tensorboardx, jaxtyping,
    # wadler-lindig, absl-py, tqdm; `pip download --no-deps --only-binary=:all: --python-version 3.12`) are carried in
    # $WHEELS (default .whl). tokamax imports xprof's kernel-stats tool at import, which the harness never calls: a
    # stand-in module takes its place rather than the 32 MB wheel.
    PEERS=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-index --target "$PEERS" "${WHEELS:-$REPO/.whl}"/*.whl \
      > "$OUT/peers_deps.log" 2>&1 || { echo "peers: wheels did not install"; tail -5 "$OUT/peers_deps.log"; }
    mkdir -p "$PEERS/xprof/cli" && touch "$PEERS/xprof/__init__.py" "$PEERS/xprof/cli/__init__.py"
    [ -f "$PEERS/xprof/cli/tools.py" ] || echo "get_kernel_stats_tool = None" > "$PEERS/xprof/cli/tools.py"
    PYTHONPATH="$PEERS" timeout ${BENCH_TIMEOUT:-500} python3 -m te_jax.bench --preset fa --head-dim 128 \
      --seq ${PEERS_SEQS:-2048,8192} --backends te_jax-te,te_jax-ffi,jax-cudnn,tokamax-mosaic,tokamax-triton,jax-fp8-cudnn \
      --baseline jax-cudnn --keep-going --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log" | grep -v Warning | tail -60 ;;
  ncu)
    # The kernels' speed of light, warp stalls, instruction mix and memory traffic (no clock control: the clocks the
    # harness sees), one profile per engine and case; NCU_CASES are "mask:seq:mode" (profile_step.py's arguments).
    # The report (CSV) stays under $OUT; scripts/ncu_summary.py prints a few lines per kernel from it.
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    for c in ${NCU_CASES:-no_mask:512:fwd no_mask:8192:fwd+bwd}; do
      IFS=: read -r mask seq mode <<< "$c"
      for engine in te cudnn; do
        report="$OUT/ncu_${engine}_${mask}_${seq}_${mode}.csv"
        timeout ${NCU_TIMEOUT:-90} "$NCU" --profile-from-start off --clock-control none --section SpeedOfLight \
          --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section LaunchStats \
          --section Occupancy --section SchedulerStats \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" --csv --page details \
          python3 "$REPO/scripts/profile_step.py" $engine $mask $seq $mode > "$report" 2>&1
        echo "== ncu $engine $mask s $seq $mode rc=$?"
        python3 "$REPO/scripts/ncu_summary.py" "$report" --skip broadcast_fusion
      done
    done ;;
  bench)
    # te_jax's engines (te, cudnn, and auto: te_jax-ffi) against JAX's cuDNN on the fa grid; BENCH_ARGS are more harness
    # flags (--head-dim 128, --mode fwd, --kv-heads 4, --window 1023, ...), BENCH_BACKENDS replaces the backends (add
    # te_jax-deterministic for the deterministic backward).
    timeout ${BENCH_TIMEOUT:-500} python3 -m te_jax.bench --preset fa \
      --backends ${BENCH_BACKENDS:-te_jax-te,te_jax-cudnn,te_jax-ffi,jax-cudnn} --keep-going --budget 450 \
      ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v Warning | tail -80 ;;
  esac
done
