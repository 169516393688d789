"""Builds kerasdist's native libraries with `make -C ops` (flags from
tf.sysconfig, MPI from the mpich wheel or KERASDIST_MPI_HOME).

TensorFlow must already be installed in the environment that builds, because
the op library is compiled against it: install with
`pip install -r requirements.txt && pip install --no-build-isolation -e .`.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    """kerasdist.__version__, read from the source (the one place it is
    written) without importing the package."""
    with open(os.path.join(HERE, "kerasdist", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


VERSION = _version()
NATIVE = ["libkerasdist_core.so", "_kerasdist_ops.so", "_build_info.json"]
# Built only when their framework is importable at build time (ops/Makefile).
OPTIONAL_NATIVE = ["_kerasdist_jax.so"]


class MakeBuild(build_ext):
    """Runs ops/Makefile into the source package, then copies the results
    where setuptools expects them."""

    def run(self):
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            sys.exit(
                "kerasdist: TensorFlow is not importable in the build "
                "environment. Install the requirements first and build "
                "without isolation:\n  pip install -r requirements.txt && "
                "pip install --no-build-isolation -e .")
        src_pkg = os.path.join(HERE, "kerasdist")
        jobs = str(os.cpu_count() or 1)
        subprocess.check_call(
            ["make", "-B", "-C", os.path.join(HERE, "ops"), f"-j{jobs}",
             f"OUT={src_pkg}", f"PYTHON={sys.executable}",
             f"VERSION={VERSION}"])
        if not self.inplace:
            dest = os.path.join(self.build_lib, "kerasdist")
            os.makedirs(dest, exist_ok=True)
            for name in NATIVE + _built(OPTIONAL_NATIVE):
                shutil.copy2(os.path.join(src_pkg, name), dest)

    def get_outputs(self):
        return []


def _built(names):
    here = os.path.join(HERE, "kerasdist")
    return [n for n in names if os.path.exists(os.path.join(here, n))]


setup(
    name="kerasdist",
    version=VERSION,
    description="Fast synchronous data-parallel training for Keras 3 on "
                "TensorFlow, JAX and PyTorch (Horovod-style, MPI and NCCL)",
    packages=find_packages(include=["kerasdist", "kerasdist.*"]),
    package_data={"kerasdist": NATIVE + OPTIONAL_NATIVE},
    ext_modules=[Extension("kerasdist._native_build_marker", sources=[])],
    cmdclass={"build_ext": MakeBuild},
    python_requires=">=3.10",
    install_requires=["numpy", "keras>=3.8,<4", "mpich", "mpi4py>=4",
                      "h5py"],
    # The JAX op library is compiled only if jax is importable when kerasdist
    # is built, and pip builds before it installs the extras: in a fresh
    # environment install jax first (pip install "jax[cpu]==0.10.2"), then
    # kerasdist with --no-build-isolation. torch needs nothing compiled.
    extras_require={"plot": ["matplotlib"], "test": ["pytest"],
                    "jax": ["jax[cpu]==0.10.2"], "torch": ["torch==2.13.0"]},
    entry_points={"console_scripts": ["kerasdist=kerasdist.tools.cli:main"]},
)
