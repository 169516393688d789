"""Single-process facts about the native library and its configuration."""

import os
import re
import subprocess
import sys

import pytest

from kerasdist._core import capi as _capi
from tests.support.helpers import REPO_ROOT


def test_every_setting_is_documented():
    names = _capi.text("config_variables").split()
    assert "KERASDIST_FUSION_THRESHOLD" in names
    with open(os.path.join(REPO_ROOT, "docs", "env_vars.md")) as f:
        documented = set(re.findall(r"`(KERASDIST_[A-Z_]+)`", f.read()))
    missing = sorted(set(names) - documented)
    assert not missing, f"add rows to docs/env_vars.md for {missing}"


def test_core_includes_no_framework():
    core = os.path.join(REPO_ROOT, "ops", "core")
    for root, _, files in os.walk(core):
        for name in files:
            with open(os.path.join(root, name)) as f:
                text = f.read()
            assert "tensorflow/" not in text, name
            assert "Python.h" not in text, name


def test_build_info_names_the_mpi_it_runs_on():
    # The truth: mpi4py, asked in a process of its own (without MPI_Init,
    # which this process must not do).
    info = dict(l.split("=", 1) for l in _capi.text("build_info").splitlines())
    assert info["mpi"] == "1"
    code = ("import mpi4py\n"
            "mpi4py.rc.initialize = False\n"
            "from mpi4py import MPI\n"
            "print(MPI.Get_library_version().splitlines()[0])\n"
            "print('%d.%d' % MPI.Get_version())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    library, standard = out.stdout.splitlines()
    assert info["mpi_library"] == library
    assert info["mpi_standard"] == standard


def test_version_mismatch_gives_a_clear_import_error(tmp_path):
    # A copy of the package whose build record names another TensorFlow.
    import shutil
    pkg = tmp_path / "kerasdist"
    shutil.copytree(os.path.join(REPO_ROOT, "kerasdist"), pkg)
    (pkg / "_build_info.json").write_text('{"tensorflow": "2.0.0"}')
    code = ("import kerasdist.tensorflow._native as n\n"
            "try:\n    n.ops()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path),
                                  TF_CPP_MIN_LOG_LEVEL="3"))
    assert "built for TensorFlow 2.0.0" in out.stdout, out.stdout + out.stderr
    assert "pip install tensorflow-cpu==2.0.0, or build kerasdist from source" \
        in out.stdout


def test_rank_before_init_says_call_init():
    code = ("import kerasdist as kd\n"
            "try:\n    kd.size()\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert "call kerasdist.init()" in out.stdout, out.stdout + out.stderr


def test_enqueue_group_before_init_queues_nothing():
    # kerasdist_enqueue_group refuses the whole group before init: -1, and
    # no handle left for the caller (every one 0); start_group raises the
    # core's message.
    import ctypes

    import numpy as np

    assert not _capi.lib().kerasdist_is_initialized()
    x = np.ones(4, np.float32)
    out = np.empty_like(x)
    f32 = _capi.DTYPES[np.dtype(np.float32)]
    member = (f32, x.shape, x.ctypes.data, out.ctypes.data, -1)
    with pytest.raises(_capi.KerasdistError, match="not initialized"):
        _capi.start_group(_capi.OP_ALLREDUCE, "g", [member, member],
                          process_set=0)
    requests = (_capi._Request * 2)()
    inputs = (ctypes.c_void_p * 2)(x.ctypes.data, x.ctypes.data)
    ids = (ctypes.c_int64 * 2)(99, 99)
    assert _capi.lib().kerasdist_enqueue_group(requests, inputs, None, 2,
                                               ids) == -1
    assert list(ids) == [0, 0]
    assert "not initialized" in _capi.last_error()


def test_enqueue_into_before_init_gives_no_handle():
    # kerasdist_enqueue_into (a result written into the caller's buffer)
    # refuses as kerasdist_enqueue does: no handle, the core's message,
    # and the buffer untouched.
    import numpy as np

    assert not _capi.lib().kerasdist_is_initialized()
    x = np.ones(4, np.float32)
    out = np.full(8, -7.0, np.float32)
    with pytest.raises(_capi.KerasdistError, match="not initialized"):
        _capi.Handle(_capi.OP_ALLGATHER, "into", _capi.DTYPES[x.dtype],
                     x.shape, x.ctypes.data, out.ctypes.data,
                     into_shape=(8,), process_set=0)
    assert (out == -7.0).all()
