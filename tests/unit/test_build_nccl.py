"""The GPU backend builds on a machine without a GPU (compile and link only).

`make -C ops gpu-check OUT=<tmp>` compiles the NCCL backend into a separate
libkerasdist_core_nccl.so against the CUDA toolkit (nvcc) and the NCCL
headers and library of the nvidia-nccl-cu13 wheel, leaving the normal build
alone. Tests skip, saying what is missing, where nvcc or NCCL is absent.
"""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
OPS = os.path.join(REPO_ROOT, "ops")


def _make(*args, timeout=60, tf=0):
    return subprocess.run(["make", "--no-print-directory", "-C", OPS,
                           f"PYTHON={sys.executable}", f"TF={tf}", *args],
                          capture_output=True, text=True, timeout=timeout)


def _version():
    with open(os.path.join(REPO_ROOT, "kerasdist", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _gpu_info(*args):
    p = _make("gpu-info", *args)
    assert p.returncode == 0, p.stderr
    return dict(l.split("=", 1) for l in p.stdout.splitlines() if "=" in l)


def _missing_reason():
    info = _gpu_info()
    if info["missing"]:
        return (f"GPU toolchain not found ({info['missing']}); install the "
                "CUDA toolkit (nvcc) and `pip install nvidia-nccl-cu13` to "
                "run this check")
    return None


@pytest.mark.slow
@pytest.mark.timeout(960)  # the build may take 900 s
def test_gpu_backend_compiles_and_links(tmp_path):
    reason = _missing_reason()
    if reason:
        pytest.skip(reason)
    # With the source package's object directory, version and TensorFlow's
    # ABI flag, the objects the editable build compiled alike are reused
    # (with the GPU backend found there, all of them: only the link runs).
    objects = os.path.join(REPO_ROOT, "kerasdist", ".kerasdist_obj")
    p = _make("gpu-check", f"OUT={tmp_path}", f"VERSION={_version()}",
              f"OBJ_DIR={objects}", timeout=900, tf=1)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lib = tmp_path / "libkerasdist_core_nccl.so"
    assert lib.exists()
    # It loads without a GPU (NCCL and CUDA start only on first device use)
    # and reports the backend it registered.
    code = ("import ctypes, sys\n"
            "l = ctypes.CDLL(sys.argv[1])\n"
            "l.kerasdist_build_info.restype = ctypes.c_char_p\n"
            "print('nccl_built', l.kerasdist_nccl_built())\n"
            "print(l.kerasdist_build_info().decode())\n")
    out = subprocess.run([sys.executable, "-c", code, str(lib)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "nccl_built 1" in out.stdout
    assert re.search(r"gpu_backend=NCCL \d+\.\d+\.\d+, CUDA \d+\.\d+",
                     out.stdout), out.stdout


def test_with_nccl_0_skips_the_gpu_backend():
    assert _gpu_info("KERASDIST_WITH_NCCL=0")["with_nccl"] == "0"


def test_auto_detection_follows_what_is_found():
    info = _gpu_info()
    assert info["with_nccl"] == ("0" if info["missing"] else "1")
    info = _gpu_info("NCCL_HOME=/nonexistent")
    assert info["with_nccl"] == "0" and "nccl.h" in info["missing"]


def test_with_nccl_1_and_nothing_found_is_a_clear_error(tmp_path):
    p = _make("KERASDIST_WITH_NCCL=1", "NCCL_HOME=/nonexistent",
              f"OUT={tmp_path}")
    assert p.returncode != 0
    assert "KERASDIST_WITH_NCCL=1 but not found" in p.stderr
    assert "nccl.h" in p.stderr and "nvidia-nccl-cu13" in p.stderr


def test_gpu_check_without_nccl_says_what_is_missing(tmp_path):
    p = _make("gpu-check", "NCCL_HOME=/nonexistent", f"OUT={tmp_path}")
    assert p.returncode != 0
    assert "gpu-check: not found" in p.stderr and "nccl.h" in p.stderr


def test_cuda_and_nccl_headers_stay_in_the_gpu_files():
    # The GPU files, compiled only with the GPU backend (ops/Makefile's
    # GPU_SRCS and the headers only they include).
    allowed = {"nccl_communicator.h", "nccl_communicator.cc",
               "staged_communicator.h", "gpu_backend.cc", "device_hooks.cc",
               "gpu_util.h", "gpu_util.cc", "on_device.h"}
    pattern = re.compile(r'#include\s*[<"](cuda|nccl|cuda_runtime)[^>"]*[>"]')
    for path in glob.glob(os.path.join(OPS, "core", "**", "*.*"),
                          recursive=True):
        with open(path) as f:
            if pattern.search(f.read()):
                assert os.path.basename(path) in allowed, path


def test_gpu_check_scripts_parse():
    with open(os.path.join(REPO_ROOT, "tests", "gpu", "gpu_check.py")) as f:
        ast.parse(f.read())
    bash = shutil.which("bash")
    if bash:
        p = subprocess.run([bash, "-n", os.path.join(
            REPO_ROOT, "tests", "gpu", "run_on_gpu.sh")],
            capture_output=True, text=True)
        assert p.returncode == 0, p.stderr


# Ops without tensors: registered on the host only.
_HOST_OPS = ("KerasdistBarrier", "KerasdistJoin")
# The collectives with CUDA handlers for TF's XLA (ops/tf/xla_ffi_cuda.cc).
_XLA_GPU_OPS = ("KerasdistAllreduce", "KerasdistGroupedAllreduce",
                "KerasdistBroadcast")
_GPU_OPS = ("KerasdistAllreduce", "KerasdistGroupedAllreduce",
            "KerasdistAllgather", "KerasdistBroadcast", "KerasdistAlltoall",
            "KerasdistReducescatter")


def test_tf_gpu_kernels_registered_exactly_when_nccl_built():
    # The op library built for this checkout registers GPU kernels for every
    # collective with tensors (alltoall's split sizes in host memory) when the
    # core has its NCCL backend, and none without it. On CPU-only TensorFlow
    # they are registered but never instantiated: this checks that they
    # compile, link and register, not that they run. With the XLA kernels
    # (TF_XLA), every collective with tensors, and the barrier, also has one
    # for XLA_CPU_JIT (join has none: it is refused inside XLA); with the
    # NCCL backend too, those with CUDA handlers one for XLA_GPU_JIT.
    code = (
        "import json\n"
        "import kerasdist as kd\n"
        "from kerasdist.tensorflow import _native\n"
        "from tensorflow.python.framework import kernels\n"
        "_native.ops()\n"
        "out = {'nccl': kd.nccl_built(), 'xla': _native.xla_kernels(),\n"
        "       'xla_gpu': _native.xla_gpu_kernels()}\n"
        "for op in " + repr(_GPU_OPS + _HOST_OPS) + ":\n"
        "    out[op] = sorted([k.device_type, sorted(k.host_memory_arg)]\n"
        "                     for k in "
        "kernels.get_registered_kernels_for_op(op).kernel)\n"
        "print('RESULT', json.dumps(out))\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=(REPO_ROOT + os.pathsep
                           + os.environ.get("PYTHONPATH", "")))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    import json
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1]
    got = json.loads(line[len("RESULT "):])
    # The XLA kernels on a GPU come with the GPU backend and the XLA ones.
    assert got["xla_gpu"] == (got["nccl"] and got["xla"]), got
    for op in _HOST_OPS:
        want = [["CPU", []]]
        if got["xla"] and op == "KerasdistBarrier":
            want.append(["XLA_CPU_JIT", []])
        if got["xla_gpu"] and op == "KerasdistBarrier":
            want.append(["XLA_GPU_JIT", []])
        kernels = got.pop(op)
        assert kernels == want, (op, kernels)
    for op in _GPU_OPS:
        want = [["CPU", []]]
        if got["nccl"]:
            host = (["received_splits", "splits"]
                    if op == "KerasdistAlltoall" else [])
            want.append(["GPU", host])
        # The XLA kernels (ops/tf/xla_kernels.cc), on the CPU's XLA only.
        if got["xla"]:
            want.append(["XLA_CPU_JIT",
                         ["splits"] if op == "KerasdistAlltoall" else []])
        if got["xla_gpu"] and op in _XLA_GPU_OPS:
            want.append(["XLA_GPU_JIT", []])
        assert got[op] == want, (op, got[op])
