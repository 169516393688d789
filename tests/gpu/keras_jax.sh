# Keras on JAX on the GPU: sourced by tests/gpu/run_on_gpu.sh (which sets
# PY, OUT, STEP_TIMEOUT, failed and say). Builds kerasdist with NCCL and
# JAX's CUDA handlers (no TensorFlow) into a scratch copy of the package,
# then runs tests/gpu/keras_jax_check.py on it:
#   np=1 through NCCL, with the bandwidth table and the step overhead;
#   np=2 on the one GPU, host-staged (KERASDIST_GPU_OPERATIONS=MPI);
# each with a timeline that must show device batches (args.backend).

say "Keras on JAX: JAX and Keras"
# A dry run (KD_GPU_DRY_RUN=1) checks the same on JAX's CPU devices.
DEVICES=gpu; EXTRA=(); [ "$DRY" = 1 ] && { DEVICES=cpu; EXTRA=(--allow-cpu); }
if ! "$PY" -c "import jax, keras; assert jax.devices('$DEVICES'); print('jax', jax.__version__, jax.devices(), 'keras', keras.__version__)"; then
  echo "FAIL: Keras on JAX needs jax with CUDA and keras"; failed=1; return
fi

say "Keras on JAX: build (TF=0, NCCL, JAX's CUDA handlers)"
PKG="$OUT/pkg"
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r kerasdist "$PKG/" && rm -f "$PKG"/kerasdist/*.so "$PKG"/kerasdist/_build_info.json
start=$(date +%s)
if ! make -C ops -j"$(nproc)" OUT="$PKG/kerasdist" TF=0 JAX=1 KERASDIST_WITH_NCCL=1 \
    OBJ_DIR="$OUT/.keras_jax_obj" PYTHON="$PY" VERSION=gpu-check >"$OUT/keras_jax_build.log" 2>&1; then
  tail -n 30 "$OUT/keras_jax_build.log"
  echo "FAIL: kerasdist with JAX's CUDA handlers did not build"; failed=1; return
fi
echo "built $PKG/kerasdist in $(( $(date +%s) - start )) s"
CHECK="$PWD/tests/gpu/keras_jax_check.py"

keras_jax() {  # keras_jax NAME NP OPERATIONS TRANSPORT [args]
  local name=$1 np=$2 ops=$3 backend=$4; shift 4
  local timeline="$OUT/keras_jax_np$np.json"
  say "Keras on JAX: $name"
  if ! (cd "$PKG" && env PYTHONPATH="$PKG" KERAS_BACKEND=jax \
      KERASDIST_GPU_OPERATIONS="$ops" KERASDIST_TIMELINE="$timeline" \
      timeout "$STEP_TIMEOUT" "$PY" -m kerasdist.run -np "$np" \
      --timeout "$STEP_TIMEOUT" "$PY" "$CHECK" "${EXTRA[@]}" "$@"); then
    echo "FAIL: Keras on JAX $name"; failed=1; return
  fi
  local phase=ALLREDUCE
  # Without a GPU there are no device batches: the dry run checks that the
  # timeline was written and holds negotiated tensors.
  [ "$DRY" = 1 ] && { backend=host; phase=NEGOTIATE; }
  "$PY" - "$timeline" "$backend" "$phase" <<'PYEOF' || { echo "FAIL: Keras on JAX $name: no device batches in the timeline"; failed=1; }
import collections, glob, json, sys
path, backend, phase = sys.argv[1:4]
events = []
for p in glob.glob(path + "*"):  # one file, or one per rank
    events += json.load(open(p))
seen = collections.Counter(
    e.get("name") for e in events
    if e.get("args", {}).get("backend", "host") == backend)
print(f"device phases ({backend}):", dict(seen))
sys.exit(0 if seen.get(phase) else 1)
PYEOF
}

keras_jax "np=1 through NCCL, bandwidth table and step overhead" 1 NCCL nccl --bench
keras_jax "np=2 on one GPU, host-staged" 2 MPI mpi-staged
