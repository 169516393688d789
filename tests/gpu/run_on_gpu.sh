#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and the CUDA toolkit (nvcc),
# no TensorFlow needed. From the repository root:
#
#   tests/gpu/run_on_gpu.sh [all|core|keras-jax|tf-xla]
#
# 1. installs what is missing of numpy, mpich, cupy-cuda13x, nvidia-nccl-cu13
#    (from wheels in .whl/ when that folder exists: offline machines; see
#    docs/gpu.md for the pip download command),
# 2. builds libkerasdist_core with the NCCL backend (TF=0, `make gpu-check`),
# 3. drives it from cupy arrays: every collective at np=1 through NCCL with a
#    bandwidth table next to cupy's NCCL; at np=2 on the one GPU with
#    KERASDIST_GPU_OPERATIONS=MPI (NCCL refuses two ranks on one GPU); and
#    checks that NCCL with two ranks on one GPU fails with a message, not a hang;
#    and that the np=1 run's timeline has the device batches.
# 4. (keras-jax) Keras on JAX: builds kerasdist itself with NCCL and JAX's
#    CUDA handlers (TF=0) into a scratch copy of the package, then runs
#    tests/gpu/keras_jax_check.py: np=1 through NCCL (collectives inside
#    jax.jit on device arrays, model.fit equivalence, a bandwidth table next
#    to cupy's NCCL on the same buffers, step overhead against plain Keras)
#    and np=2 on the one GPU host-staged (KERASDIST_GPU_OPERATIONS=MPI),
#    each with a timeline that must show the device path. Needs jax with
#    CUDA and keras (missing ones come from .whl/: tests/gpu/fetch_wheels.sh).
# 5. (tf-xla) TensorFlow's XLA: builds kerasdist with NCCL and TF's XLA
#    kernels' CUDA handlers (JAX=0) into a scratch copy, then runs
#    tests/gpu/tf_xla_check.py (tests/gpu/tf_xla.sh): the collectives inside
#    tf.function(jit_compile=True) on GPU tensors, and model.fit with
#    jit_compile=True against one process, at np=1 (NCCL) and np=2
#    (host-staged). Needs tensorflow with CUDA and keras.
# `core` runs 1-3, `keras-jax` only 4, `tf-xla` only 5, `all` (default)
# 1-4 (5 when TensorFlow sees a GPU).
# KD_GPU_DRY_RUN=1 with keras-jax: the dry run on a machine without a GPU
# (installs nothing, runs the check on JAX's CPU devices).
# Exit status 0 when every check passed. A few minutes at most.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHAT=${1:-all}
case "$WHAT" in all|core|keras-jax|tf-xla) ;; *) echo "usage: $0 [all|core|keras-jax|tf-xla]"; exit 2;; esac
OUT=${KD_GPU_OUT:-$(mktemp -d)}
STEP_TIMEOUT=${KD_GPU_STEP_TIMEOUT:-240}
DRY=${KD_GPU_DRY_RUN:-0}
failed=0
say() { printf '\n=== %s\n' "$*"; }

say "machine"
nvidia-smi -L || echo "nvidia-smi failed: is there a GPU and a driver?"
"$PY" --version

say "dependencies"
if [ "$DRY" = 1 ]; then
  echo "dry run: installing nothing"
else
need=()
"$PY" -c 'import numpy' 2>/dev/null || need+=(numpy)
"$PY" -c 'import mpi4py' 2>/dev/null || true  # not needed here
[ -x "$("$PY" -c 'import sys; print(sys.prefix)')/bin/mpiexec" ] || command -v mpiexec >/dev/null || need+=(mpich)
"$PY" -c 'import cupy' 2>/dev/null || need+=(cupy-cuda13x)
"$PY" -c 'import nvidia.nccl' 2>/dev/null || need+=(nvidia-nccl-cu13)
if [ "$WHAT" != core ]; then
  "$PY" -c 'import keras' 2>/dev/null || need+=(keras)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --find-links .whl "${need[@]}" || exit 2
  else
    "$PY" -m pip install -q "${need[@]}" || exit 2
  fi
fi
"$PY" -c 'import cupy, numpy; print("cupy", cupy.__version__, "numpy", numpy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())'
fi

if [ "$WHAT" = all ] || [ "$WHAT" = core ]; then
say "build (make gpu-check, TF=0)"
start=$(date +%s)
if ! make -C ops -j"$(nproc)" gpu-check OUT="$OUT" PYTHON="$PY" VERSION=gpu-check; then
  echo "FAIL: the GPU backend did not build (see above)"; exit 3
fi
LIB="$OUT/libkerasdist_core_nccl.so"
echo "built $LIB in $(( $(date +%s) - start )) s"

run() {  # run NAME NP [env...] -- args
  local name=$1 np=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  say "$name"
  env "${envs[@]}" timeout "$STEP_TIMEOUT" "$PY" -m kerasdist.run -np "$np" \
    --timeout "$STEP_TIMEOUT" "$PY" tests/gpu/gpu_check.py --lib "$LIB" "$@"
}

run "np=1, NCCL, with bandwidth table and a timeline" 1 KERASDIST_GPU_OPERATIONS=NCCL \
  KERASDIST_TIMELINE="$OUT/timeline.json" -- --bench \
  || { echo "FAIL: np=1 NCCL"; failed=1; }
say "timeline: device batches recorded"
"$PY" - "$OUT/timeline.json" <<'PYEOF' || { echo "FAIL: timeline"; failed=1; }
import collections, json, sys
events = json.load(open(sys.argv[1]))
on_gpu = collections.Counter(e["name"] for e in events
                             if e.get("args", {}).get("backend") == "nccl")
print("device phases:", dict(on_gpu))
sys.exit(0 if on_gpu.get("ALLREDUCE") and on_gpu.get("ALLGATHER") else 1)
PYEOF
run "np=2 on one GPU, host-staged MPI" 2 KERASDIST_GPU_OPERATIONS=MPI -- --bench --iters 5 \
  || { echo "FAIL: np=2 host-staged"; failed=1; }

say "np=2 on one GPU with NCCL: must fail with a message within 120 s"
log="$OUT/nccl_two_ranks.log"
KERASDIST_GPU_OPERATIONS=NCCL timeout 150 "$PY" -m kerasdist.run -np 2 --timeout 120 \
  "$PY" tests/gpu/gpu_check.py --lib "$LIB" >"$log" 2>&1
rc=$?
tail -n 8 "$log"
if [ $rc -eq 0 ]; then
  echo "note: NCCL accepted two ranks on one GPU here (newer NCCL); checks passed"
elif grep -q "NCCL error" "$log" && [ $rc -ne 124 ]; then
  echo "OK: failed cleanly (exit $rc) with an NCCL error message"
else
  echo "FAIL: exit $rc without an NCCL error message (124 = hang)"; failed=1
fi

fi

if [ "$WHAT" = all ] || [ "$WHAT" = keras-jax ]; then
  . tests/gpu/keras_jax.sh
fi
if [ "$WHAT" = tf-xla ] || { [ "$WHAT" = all ] && "$PY" -c 'import tensorflow as tf, sys; sys.exit(not tf.config.list_physical_devices("GPU"))' 2>/dev/null; }; then
  . tests/gpu/tf_xla.sh
fi

say "result"
if [ $failed -eq 0 ]; then echo "GPU check PASSED"; else echo "GPU check FAILED"; fi
exit $failed
