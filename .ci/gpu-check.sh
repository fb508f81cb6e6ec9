#!/usr/bin/env bash
# The GPU validation run, in one call on a GPU machine (see docs/gpu.md):
#   source .gpu/device-prelude.sh && make gpu-check
# Builds streamsched._C with CUDA and checks it (.ci/check_cuda_ext.py), then runs every
# test (the cuda-marked ones included), the CUDA tests again under PyTorch's stream
# sanitizer, the GPU benchmarks and a timeline (none of these if the build fails);
# writes everything under $OUT (at most 8 files: a summary, logs and results packed in
# one archive, the timeline picture) and prints a short table last. Each stage has a
# time budget so the whole run stays under 10 minutes.
set -uo pipefail
OUT_DIR="${1:-${OUT:-out/gpu}}"
mkdir -p "$OUT_DIR/all"
ALL="$OUT_DIR/all"
# STREAMSCHED_FAILURES_AT_ONCE: each failing test's traceback in the log when it fails
# (tests/conftest.py), so a stage cut by its budget still says why.
export PYTHONUNBUFFERED=1 STREAMSCHED_REQUIRE_EXT=1 MAX_JOBS="${MAX_JOBS:-16}" STREAMSCHED_FAILURES_AT_ONCE=1
PY="${PYTHON:-python3}"
status() { printf '%-28s %s\n' "$1" "$2" | tee -a "$ALL/status.txt"; }
DEADLINE=${GPU_CHECK_DEADLINE:-540}  # seconds for the whole run: one device call is 10 minutes
# GPU_CHECK_ONLY="bench prefetch": run only these stages after the build (which always
# runs): everything does not fit in one call, so a second call can take the rest.
ONLY=${GPU_CHECK_ONLY:-}
# The cuda-marked tests and the sanitizer run in this many pytest workers on the one GPU
# (each a process with its own allocator; whole files to a worker, so a file's order
# holds): one worker ran out of its budget with a fifth of the tests left (2026-11-27).
WORKERS=${GPU_TEST_WORKERS:-6}
XDIST=(-n "$WORKERS" --dist loadfile)
(( WORKERS > 1 )) || XDIST=()
# GPU_BENCH_ARGS: the benchmark's cases (default: the fused, training and multi-stream
# rows without torch.compile; the whole suite does not fit beside the tests).
read -r -a BENCH_ARGS <<< "${GPU_BENCH_ARGS:---models critic_ensemble,parallel_fcn,multitask_heads,inception3 --no-compile --rounds 5}"
stage() {  # stage NAME SECONDS COMMAND...  (skipped when the run's deadline is near)
  local name=$1 budget=$2; shift 2
  local start=$SECONDS
  if [ -n "$ONLY" ] && [[ " build ext-check info $ONLY " != *" $name "* ]]; then
    status "$name" "skipped (GPU_CHECK_ONLY)"; return 0
  fi
  if (( SECONDS + 20 > DEADLINE )); then status "$name" "skipped (deadline)"; return 0; fi
  (( SECONDS + budget > DEADLINE )) && budget=$(( DEADLINE - SECONDS ))
  timeout "$budget" "$@" > "$ALL/$name.log" 2>&1
  local rc=$?
  status "$name" "rc=$rc $((SECONDS - start))s"
  tail -n 3 "$ALL/$name.log"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > "$ALL/nvidia-smi.csv" 2>&1
# The toolkit setup.py would pick ($CUDA_HOME, /usr/local/cuda, the nvcc on PATH with
# wrappers resolved), exported for the build and for anything that compiles later.
CUDA_HOME="${CUDA_HOME:-$("$PY" setup.py --print-cuda-home 2>/dev/null)}"
export CUDA_HOME
status toolkit "${CUDA_HOME:-none found}"
# Everything after the build needs the extension (STREAMSCHED_REQUIRE_EXT=1): if it does
# not build, stop here with the build log rather than spend the run on failing stages.
if [ -n "$CUDA_HOME" ] && stage build 240 env USE_CUDA=1 "$PY" setup.py build_ext --inplace \
  && stage ext-check 60 "$PY" .ci/check_cuda_ext.py built .; then
  stage info 30 "$PY" -m streamsched info --json
  cp "$ALL/info.log" "$ALL/env.json" 2>/dev/null
  # Most telling first, in case the deadline cuts the run: the cuda-marked tests on the
  # device (verbose with each test's time, so a cut log still names each result), DDP on
  # CUDA and the sanitizer (correctness), then the demo and the benchmarks.
  # (2026-11-27 on an H200: the cuda-marked tests ran 190 s to 78% without the DDP test,
  # which gets a stage of its own; test_cuda.py alone takes 7 s.)
  stage cuda-tests 200 "$PY" -m pytest -v --tb=short -p no:cacheprovider -m cuda tests -o addopts="-ra" \
    "${XDIST[@]}" --durations=25 --timeout 90 \
    --deselect tests/test_distributed.py::test_ddp_on_cuda_with_side_streams_equals_single_process_training
  stage ddp 45 "$PY" -m pytest -v --tb=short -p no:cacheprovider -o addopts="-ra" \
    tests/test_distributed.py::test_ddp_on_cuda_with_side_streams_equals_single_process_training
  # The sanitizer does not follow graph captures: tests that capture (and the benchmark
  # suite's quick run, whose peers capture) are left out.
  stage sanitizer 90 env TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -v -p no:cacheprovider -m cuda tests \
    -k "not graph and not capture and not peak_memory and not quick_suite" -o addopts="" --timeout 90 \
    "${XDIST[@]}"
  stage demo 60 "$PY" examples/inception.py --rounds 5
  stage timeline 40 "$PY" -m streamsched timeline benchmarks.zoo:Inception3 --input-shape 1,3,299,299 \
    --device cuda --out "$ALL/inception_b1"
  stage overhead 30 "$PY" benchmarks/overhead_bench.py --device cuda --out "$ALL/overhead.json"
  stage bench 150 "$PY" -m streamsched bench --device cuda "${BENCH_ARGS[@]}" --out "$ALL/bench"
  stage prefetch 30 "$PY" benchmarks/prefetch_bench.py --out "$ALL/prefetch.json"
  # The rest of the suite (what CI runs without a GPU) with whatever time is left.
  stage tests 120 "$PY" -m pytest -q -p no:cacheprovider tests -m "not slow and not cuda" -o addopts="-ra" \
    -n 12 --timeout 120
else
  status "remaining stages" "skipped: no CUDA build of streamsched._C (see build)"
  BUILD_FAILED=1
fi

{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo; echo '```'; cat "$ALL/nvidia-smi.csv"; echo '```'
  echo; echo "## Stages"; echo '```'; cat "$ALL/status.txt"; echo '```'
  if [ -n "${BUILD_FAILED:-}" ]; then
    echo; echo "## Build"; echo '```'; tail -n 40 "$ALL/build.log" "$ALL/ext-check.log" 2>/dev/null; echo '```'
  fi
  echo; echo "## CUDA tests"; echo '```'; grep -E "FAILED|ERROR" "$ALL/cuda-tests.log" | head -n 30; tail -n 8 "$ALL/cuda-tests.log"; echo '```'
  echo; echo "## Failures as they happened (first 120 lines)"; echo '```'
  sed -n '/^--- .* failed (/,/^---$/p' "$ALL"/cuda-tests.log "$ALL"/ddp.log "$ALL"/sanitizer.log 2>/dev/null | head -n 120; echo '```'
  echo; echo "## Demo"; echo '```'; tail -n 25 "$ALL/demo.log"; echo '```'
  echo; echo "## DDP on CUDA"; echo '```'; tail -n 15 "$ALL/ddp.log"; echo '```'
  echo; echo "## Other tests"; echo '```'; tail -n 25 "$ALL/tests.log"; echo '```'
  echo; echo "## Sanitizer"; echo '```'; tail -n 10 "$ALL/sanitizer.log"; echo '```'
  if [ -f "$ALL/bench/bench.md" ]; then echo; echo "## Benchmarks"; cat "$ALL/bench/bench.md"; fi
  echo; echo "## Timeline"; echo '```'; tail -n 15 "$ALL/timeline.log"; echo '```'
} > "$OUT_DIR/summary.md"
cp "$ALL"/inception_b1.png "$OUT_DIR/" 2>/dev/null
tar -czf "$OUT_DIR/results.tar.gz" -C "$OUT_DIR" all && rm -rf "$ALL"
echo
cat "$OUT_DIR/summary.md" | head -n 80
