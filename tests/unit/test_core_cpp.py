"""The core's C++ unit tests (ops/tests/), one pytest case each.

`make -C ops core-tests` builds kerasdist_core_tests: ranks are threads over
the in-process communicator, so negotiation, fusion planning, the backends'
reduce logic and their error paths run in milliseconds, without MPI
processes. The build goes to build/core-tests in the repository (make
rebuilds only what changed) or to $KERASDIST_CORE_TESTS_DIR; the core's
MPI-free objects are the package build's (kerasdist/.kerasdist_obj, where
`pip install -e .` compiled them with the same flags), so only the tests
compile.
"""

import functools
import os
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
OUT = os.environ.get("KERASDIST_CORE_TESTS_DIR",
                     os.path.join(REPO_ROOT, "build", "core-tests"))
BINARY = os.path.join(OUT, "kerasdist_core_tests")


def _no_compiler():
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) or os.environ.get("CI") == "true":
        return None
    return f"no C++ compiler ({cxx}) on PATH"


@functools.lru_cache(maxsize=None)
def _build():
    """Builds the binary once per session; returns make's error, if any."""
    jobs = min(4, os.cpu_count() or 1)
    p = subprocess.run(
        ["make", "--no-print-directory", f"-j{jobs}", "-C",
         os.path.join(REPO_ROOT, "ops"), "core-tests", f"OUT={OUT}",
         "OBJ_DIR=" + os.path.join(REPO_ROOT, "kerasdist", ".kerasdist_obj"),
         f"PYTHON={sys.executable}"],
        capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        return (p.stdout + p.stderr)[-4000:]
    return None


def _names():
    # Collection must not build (or fail) where there is no compiler:
    # list what a fresh binary has, else the sources' KD_TEST names.
    tests_dir = os.path.join(REPO_ROOT, "ops", "tests")
    names = []
    for f in sorted(os.listdir(tests_dir)):
        if not f.endswith(".cc"):
            continue
        with open(os.path.join(tests_dir, f)) as src:
            for line in src:
                if line.startswith("KD_TEST("):
                    names.append(line[len("KD_TEST("):line.index(")")])
    return names


@pytest.mark.parametrize("name", _names())
def test_core_cpp(name):
    reason = _no_compiler()
    if reason:
        pytest.skip(reason)
    error = _build()
    assert error is None, f"make core-tests failed:\n{error}"
    p = subprocess.run([BINARY, "--run", name], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_binary_lists_every_test():
    reason = _no_compiler()
    if reason:
        pytest.skip(reason)
    assert _build() is None
    p = subprocess.run([BINARY, "--list"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split()) == sorted(_names())
