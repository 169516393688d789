"""Builds kerasdist's native libraries with `make -C ops` (flags from
tf.sysconfig, MPI from the mpich wheel or KERASDIST_MPI_HOME).

TensorFlow must already be installed in the environment that builds, because
the op library is compiled against it: install with
`pip install -r requirements.txt && pip install --no-build-isolation -e .`.
Building needs make and a C++17 compiler (g++ 8 or later, or $CXX); a wheel
(`make wheel`) installs without either.

An editable install builds into the source package (kerasdist/); a wheel
(`pip wheel`, `pip install .`, `make wheel`) into build/, with RELOCATABLE=1
so that the core finds the mpich wheel's libmpi wherever it is installed.
`make` rebuilds only what is out of date. pip hides the build's output, so
short progress lines go to pip's own stderr (a terminal, a pipe, a CI log
or a file it is redirected to alike).
"""

import collections
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time

from setuptools import Extension
from setuptools import find_packages
from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SRC_PKG = os.path.join(HERE, "kerasdist")


def _version():
    """kerasdist.__version__, read from the source (the one place it is
    written) without importing the package."""
    with open(os.path.join(SRC_PKG, "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


VERSION = _version()
NATIVE = ["libkerasdist_core.so", "_kerasdist_ops.so", "_build_info.json"]
# Built only when jax is importable at build time (ops/Makefile); then
# _build_info.json names its version.
JAX_NATIVE = "_kerasdist_jax.so"
# A library's link line in make's output (`... -o DIR/NAME.so ...`).
_LINKED = re.compile(r"\s-o\s+(\S+\.so)(?:\s|$)")


def _pip_ancestor(levels=4):
    """The pid of the pip process this build runs under (pip, pip3.11,
    `python -m pip`, `uv pip`), looking a few parents up, or None."""
    pid = os.getppid()
    for _ in range(levels):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace")
                        for a in f.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if any(os.path.basename(a).startswith("pip") for a in argv):
            return pid
        pid = parent
    return None


def _share_fd(pid, fd):
    """A duplicate of process `pid`'s descriptor `fd` (pidfd_getfd): the
    same open file, sharing its offset, or None where the kernel refuses
    (before Linux 5.6, or without the right to trace `pid`)."""
    import ctypes
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        out = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd, every arch
        return out if out >= 0 else None
    finally:
        os.close(pidfd)


class _Progress:
    """Short lines past pip's capture of the build's output: written to
    pip's own stderr, so they show wherever pip's output goes (a terminal,
    a pipe, a CI log); the terminal if that cannot be opened; this
    process's stderr when no pip runs the build.

    Where pip's stderr is a file (`pip install ... > log 2>&1`), the lines
    go through pip's own descriptor, which shares pip's place in the
    file: written at the end instead, pip's next line would overwrite
    them. Where that descriptor cannot be had, a file gets no lines."""

    def __init__(self):
        self._out = None
        pip = _pip_ancestor()
        targets = ([f"/proc/{pip}/fd/2", "/dev/tty"] if pip is not None
                   else [])
        for path in targets:
            try:
                if path.startswith("/proc/") and stat.S_ISREG(
                        os.stat(path).st_mode):
                    fd = _share_fd(pip, 2)
                    if fd is None:
                        continue
                    self._out = os.fdopen(fd, "a")
                else:
                    # Append: a terminal or pipe has no place to share.
                    self._out = open(path, "a")
                break
            except OSError:
                continue
        self._own = pip is None

    def say(self, line):
        out = sys.stderr if self._own else self._out
        if out is None:
            return
        try:
            out.write(line + "\n")
            out.flush()
        except OSError:
            self._out = None

    def close(self):
        if self._out is not None:
            self._out.close()


def _check_tools():
    """Exits with one line when make or a C++17 compiler is missing."""
    cxx = shlex.split(os.environ.get("CXX") or "g++")
    missing = [t for t in ("make", cxx[0]) if shutil.which(t) is None]
    if missing:
        sys.exit(f"kerasdist: building from source needs make and a C++17 "
                 f"compiler, and {' and '.join(missing)} "
                 f"{'is' if len(missing) == 1 else 'are'} not on PATH: "
                 "install them (Debian/Ubuntu: apt-get install g++ make; or "
                 "set CXX), or install a kerasdist wheel, which needs "
                 "neither (`make wheel` builds one).")
    probe = subprocess.run(
        cxx + ["-std=c++17", "-x", "c++", "-fsyntax-only", "-"],
        input="#include <optional>\nstd::optional<int> x;\n",
        capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no message"])[0]
        sys.exit(f"kerasdist: {' '.join(cxx)} does not compile C++17 "
                 f"({why}): install g++ 8 or later, or set CXX to a C++17 "
                 "compiler.")


def _make(out, relocatable, progress):
    """Runs ops/Makefile into `out`; one progress line per library built."""
    cmd = ["make", "--no-print-directory", "--output-sync=target",
           "-C", os.path.join(HERE, "ops"), f"-j{os.cpu_count() or 1}",
           f"OUT={out}", f"PYTHON={sys.executable}", f"VERSION={VERSION}",
           # One object cache for the editable build and the wheel's: what
           # both compile alike is compiled once (ops/Makefile).
           f"OBJ_DIR={os.path.join(SRC_PKG, '.kerasdist_obj')}"]
    if relocatable:
        cmd.append("RELOCATABLE=1")
    progress.say("kerasdist: building the native libraries (about 2 minutes "
                 "from scratch; C++17 compiler and make needed)...")
    start = time.monotonic()
    built = []
    tail = collections.deque(maxlen=20)
    # --output-sync: a library's link line comes when it is built.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip())
        m = _LINKED.search(line)
        if m:
            built.append(os.path.basename(m.group(1)))
            progress.say(f"kerasdist:   built {built[-1]} "
                         f"({time.monotonic() - start:.0f} s)")
    if proc.wait() != 0:
        errors = [l for l in tail if "***" in l or "error:" in l]
        why = (errors or list(tail) or ["no output"])[0]
        progress.say("kerasdist: the native build failed (pip shows "
                     "make's output)")
        sys.exit(f"kerasdist: building the native libraries failed (make "
                 f"exited with {proc.returncode}): {why}")
    progress.say(f"kerasdist: native libraries built in "
                 f"{time.monotonic() - start:.0f} s" if built else
                 "kerasdist: native libraries up to date")


class MakeBuild(build_ext):
    """Runs ops/Makefile, into the source package for an editable install,
    else into build/ and from there into the wheel."""

    def run(self):
        editable = self.inplace or getattr(self, "editable_mode", False)
        _check_tools()
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            sys.exit(
                "kerasdist: TensorFlow is not importable in the build "
                "environment. Install the requirements first and build "
                "without isolation:\n  pip install -r requirements.txt && "
                "pip install --no-build-isolation -e .")
        out = SRC_PKG if editable else os.path.abspath(
            os.path.join(self.build_temp, "native"))
        progress = _Progress()
        try:
            _make(out, not editable, progress)
        finally:
            progress.close()
        if not editable:
            dest = os.path.join(self.build_lib, "kerasdist")
            os.makedirs(dest, exist_ok=True)
            with open(os.path.join(out, "_build_info.json")) as f:
                names = NATIVE + ([JAX_NATIVE] if "jax" in json.load(f)
                                  else [])
            for name in NATIVE + [JAX_NATIVE]:
                if os.path.exists(os.path.join(dest, name)):
                    os.remove(os.path.join(dest, name))
            for name in names:
                shutil.copy2(os.path.join(out, name), dest)

    def get_outputs(self):
        return []


setup(
    name="kerasdist",
    version=VERSION,
    description="Fast synchronous data-parallel training for Keras 3 on "
                "TensorFlow, JAX and PyTorch (Horovod-style, MPI and NCCL)",
    packages=find_packages(include=["kerasdist", "kerasdist.*"]),
    ext_modules=[Extension("kerasdist._native_build_marker", sources=[])],
    cmdclass={"build_ext": MakeBuild},
    python_requires=">=3.10",
    install_requires=["numpy", "keras>=3.8,<4", "mpich", "mpi4py>=4",
                      "h5py"],
    # The JAX op library is compiled only if jax is importable when kerasdist
    # is built, and pip builds before it installs the extras: in a fresh
    # environment install jax first (pip install "jax[cpu]==0.10.2"), then
    # kerasdist with --no-build-isolation. torch needs nothing compiled.
    # The wheel (`make wheel`) carries the JAX op library already.
    extras_require={"plot": ["matplotlib"], "test": ["pytest"],
                    "jax": ["jax[cpu]==0.10.2"], "torch": ["torch==2.13.0"],
                    # kerasdist.ray: the Ray Train backend.
                    "ray": ["ray[train]==2.60.0"]},
    entry_points={"console_scripts": ["kerasdist=kerasdist.tools.cli:main"]},
)
