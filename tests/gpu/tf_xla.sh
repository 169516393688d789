# TensorFlow's XLA on the GPU: sourced by tests/gpu/run_on_gpu.sh (which sets
# PY, OUT, STEP_TIMEOUT, DRY, failed and say). Builds kerasdist with NCCL and
# TF's XLA kernels with their CUDA handlers (ops/tf/xla_ffi_cuda.cc; JAX=0)
# into a scratch copy of the package, then runs tests/gpu/tf_xla_check.py on
# it: np=1 through NCCL, np=2 on the one GPU host-staged
# (KERASDIST_GPU_OPERATIONS=MPI). Needs TensorFlow with CUDA
# (tensorflow[and-cuda]) and keras.

say "TF XLA: TensorFlow with a GPU"
EXTRA=(); [ "$DRY" = 1 ] && EXTRA=(--allow-cpu)
if ! "$PY" -c "import tensorflow as tf, keras; print('tensorflow', tf.__version__, tf.config.list_physical_devices('GPU'), 'keras', keras.__version__); assert '$DRY' == '1' or tf.config.list_physical_devices('GPU')"; then
  echo "FAIL: TF XLA needs tensorflow with CUDA and keras"; failed=1; return
fi

say "TF XLA: build (TF=1, NCCL, the XLA kernels' CUDA handlers)"
TFPKG="$OUT/tfpkg"
rm -rf "$TFPKG" && mkdir -p "$TFPKG"
cp -r kerasdist "$TFPKG/" && rm -f "$TFPKG"/kerasdist/*.so "$TFPKG"/kerasdist/_build_info.json
start=$(date +%s)
if ! make -C ops -j"$(nproc)" OUT="$TFPKG/kerasdist" TF=1 JAX=0 KERASDIST_WITH_NCCL=1 \
    OBJ_DIR="$OUT/.tf_xla_obj" PYTHON="$PY" VERSION=gpu-check >"$OUT/tf_xla_build.log" 2>&1; then
  tail -n 30 "$OUT/tf_xla_build.log"
  echo "FAIL: kerasdist with TF's XLA CUDA handlers did not build"; failed=1; return
fi
echo "built $TFPKG/kerasdist in $(( $(date +%s) - start )) s"
TFCHECK="$PWD/tests/gpu/tf_xla_check.py"

tf_xla() {  # tf_xla NAME NP OPERATIONS
  say "TF XLA: $1"
  if ! (cd "$TFPKG" && env PYTHONPATH="$TFPKG" KERAS_BACKEND=tensorflow \
      KERASDIST_GPU_OPERATIONS="$3" timeout "$STEP_TIMEOUT" "$PY" -m kerasdist.run \
      -np "$2" --timeout "$STEP_TIMEOUT" "$PY" "$TFCHECK" "${EXTRA[@]}"); then
    echo "FAIL: TF XLA $1"; failed=1
  fi
}

tf_xla "np=1 through NCCL" 1 NCCL
tf_xla "np=2 on one GPU, host-staged" 2 MPI
