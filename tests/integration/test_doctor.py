"""`kerasdist doctor` and `kerasdist check-build`, run as a user would."""

import ctypes
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.tools import doctor  # noqa: E402
from tests.support.helpers import launcher_env  # noqa: E402


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "kerasdist.tools.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=launcher_env(env))


def test_check_build_prints_the_table():
    p = _cli("check-build")
    assert p.returncode == 0, p.stderr
    for row in ("kerasdist", "TensorFlow built for", "TensorFlow running",
                "Keras", "MPI library", "NCCL", "CUDA"):
        assert any(l.startswith(row) for l in p.stdout.splitlines()), row


@pytest.mark.parallel
@pytest.mark.slow
def test_doctor_passes_on_a_working_install():
    p = _cli("doctor", "--np", "2", "--timeout", "120")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2-rank self-test" in p.stdout
    assert "# all checks passed" in p.stdout
    for line in p.stdout.splitlines()[:-1]:
        assert line.split()[0] in ("OK", "WARN", "--"), line


# A process that lets any process read it (as every rank does) and prints
# the pid and address of 16 known bytes, then waits for its stdin to close.
_HOLDER = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(-1), 0, 0, 0)
buf = ctypes.create_string_buffer(b"kerasdist-probe!", 16)
print(os.getpid(), ctypes.addressof(buf), flush=True)
sys.stdin.read()
"""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _in_place_reads_allowed():
    """Whether this machine lets one process read another's memory with
    process_vm_readv, as the in-place allreduce does: probed here, on a
    child that allows it as the ranks do (seccomp or Yama may forbid it)."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        pid, address = map(int, holder.stdout.readline().split())
        got = ctypes.create_string_buffer(16)
        local = _IoVec(ctypes.addressof(got), 16)
        remote = _IoVec(address, 16)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        n = libc.process_vm_readv(pid, ctypes.byref(local), 1,
                                  ctypes.byref(remote), 1, 0)
        return n == 16 and got.raw == b"kerasdist-probe!"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


@pytest.mark.parallel
@pytest.mark.slow
@pytest.mark.timeout(600)  # three self-tests of up to 120 s each, and start-up
def test_doctor_says_which_path_large_allreduces_take():
    # The self-test's 1 MiB allreduce reports the path it took, which follows
    # the settings and the machine: in-place reads where process_vm_readv is
    # allowed, else the slots, else MPI.
    p = _cli("doctor", "--np", "2", "--timeout", "120")
    assert p.returncode == 0, p.stdout + p.stderr
    if _in_place_reads_allowed():
        assert "read the other ranks' tensors in place" in p.stdout, p.stdout
    else:
        assert ("shared-memory slots (in-place reads are not allowed"
                in p.stdout), p.stdout
    # The backend list (first enabled wins) follows the same settings; the
    # GPU entry is there in builds with the GPU backend only.
    assert re.search(r"backends, first enabled wins: "
                     r"(gpu,)?self,adasum,(cma,)?shm,mpi", p.stdout), p.stdout
    p = _cli("doctor", "--np", "2", "--timeout", "120",
             env=dict(os.environ, KERASDIST_CMA_ALLREDUCE="0"))
    assert "go through shared-memory slots" in p.stdout, p.stdout
    assert re.search(r"backends, first enabled wins: "
                     r"(gpu,)?self,adasum,shm,mpi\b", p.stdout), p.stdout
    p = _cli("doctor", "--np", "2", "--timeout", "120",
             env=dict(os.environ, KERASDIST_SHM_ALLREDUCE="0"))
    assert "large allreduces use MPI" in p.stdout, p.stdout
    assert re.search(r"backends, first enabled wins: "
                     r"(gpu,)?self,adasum,mpi\b", p.stdout), p.stdout


@pytest.mark.parallel
def test_doctor_fails_and_says_so_when_the_selftest_fails():
    env = dict(os.environ, KERASDIST_FUSION_THRESHOLD="lots")
    p = _cli("doctor", "--timeout", "60", env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL  2-rank self-test failed" in p.stdout
    assert "KERASDIST_FUSION_THRESHOLD" in p.stdout


def test_gpu_lines():
    built = {"nccl": "1", "gpu_backend": "NCCL 2.32.3, CUDA 13.0"}
    cpu = {"nccl": "0"}
    assert doctor.gpu_checks(cpu, None, 2)[0][0] == doctor.INFO
    lines = doctor.gpu_checks(cpu, ["GPU 0: H200"], 1)
    assert lines[0][0] == doctor.WARN and "KERASDIST_WITH_NCCL=1" in lines[0][1]
    lines = doctor.gpu_checks(built, ["GPU 0: H200"], 2)
    assert (lines[-1][0] == doctor.WARN
            and "KERASDIST_GPU_OPERATIONS=MPI" in lines[-1][1])
    lines = doctor.gpu_checks(built, ["GPU 0", "GPU 1", "GPU 2", "GPU 3"], 2)
    assert lines[-1][0] == doctor.OK and "2 per local rank" in lines[-1][1]


def test_shm_line_says_what_to_do():
    from kerasdist.tools.doctor import INFO
    from kerasdist.tools.doctor import OK
    from kerasdist.tools.doctor import WARN
    from kerasdist.tools.doctor import shm_check

    mib = 1 << 20
    assert shm_check(4096 * mib, 2, "1")[0] == OK
    status, text = shm_check(64 * mib, 2, "1")
    assert status == WARN and "--shm-size" in text and "64 MiB free" in text
    status, text = shm_check(None, 2, "1")
    assert status == WARN and "no /dev/shm" in text
    assert shm_check(None, 2, "0")[0] == INFO


def test_huge_pages_line():
    from kerasdist.tools.doctor import INFO
    from kerasdist.tools.doctor import OK
    from kerasdist.tools.doctor import huge_pages_check
    assert huge_pages_check("madvise", ("glibc", "2.36"))[0] == OK
    assert huge_pages_check("always", ("glibc", "2.35"))[0] == OK
    for mode, libc, says in ((None, ("glibc", "2.36"), "absent"),
                             ("never", ("glibc", "2.36"), "never"),
                             ("madvise", ("glibc", "2.31"), "2.31"),
                             ("madvise", ("", ""), "unknown")):
        status, text = huge_pages_check(mode, libc)
        assert status == INFO and says in text, text
    # This machine's own line is one of those, and names its mode.
    status, text = huge_pages_check(doctor._thp_mode(), ("glibc", "2.36"))
    assert str(doctor._thp_mode() or "absent") in text
