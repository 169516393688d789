"""`kerasdist doctor` and `kerasdist check-build`: is this install usable?

    kerasdist check-build      what the native library was built with
    kerasdist doctor           install checks plus a 2-rank self-test
    kerasdist doctor --np 4    the self-test on 4 ranks

`doctor` prints one line per check, `OK` or what to do about it, and exits
nonzero when a check failed. Its self-test runs every collective through the
launcher (`python -m kerasdist.run -np N python -m kerasdist.tools.doctor
--selftest`) from numpy via the C API, so it needs neither TensorFlow nor a GPU.

Over 500 lines: one command, whose checks (a few lines each) read in the order
their lines print.
"""

import argparse
import ctypes
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

import kerasdist
from kerasdist._core import build_check as _build_check
from kerasdist._core import capi as _capi
from kerasdist._core import site_mpi
from kerasdist._core.keras_backend import active_backend

OK, WARN, FAIL, INFO = "OK", "WARN", "FAIL", "--"
# TensorFlow's start-up chatter would drown the report.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# ---- facts ------------------------------------------------------------------

def _native_info():
    """(build_info dict, None) or (None, error text)."""
    try:
        lines = _capi.text("build_info").splitlines()
    except (ImportError, OSError) as e:
        return None, str(e)
    return dict(l.split("=", 1) for l in lines if "=" in l), None


def _built_for(framework="tensorflow"):
    """The version the op library of `framework` was built for, or None."""
    return _build_check.build_info(
        os.path.join(_capi.NATIVE_DIR, "_build_info.json")).get(framework)


# Distributions that install each module, for its version without the
# seconds an import of TensorFlow or JAX takes.
_DISTRIBUTIONS = {"tensorflow": ("tensorflow-cpu", "tensorflow",
                                 "tensorflow-gpu", "tf-nightly"),
                  "keras": ("keras",), "jax": ("jax",), "torch": ("torch",)}


def _version(module):
    """(installed version, None) or (None, why not), read from the
    package's metadata when it has any, else by importing it."""
    for dist in _DISTRIBUTIONS.get(module, ()):
        try:
            return importlib.metadata.version(dist), None
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        return __import__(module).__version__, None
    except Exception as e:  # noqa: BLE001 - any import failure is a finding
        return None, f"{type(e).__name__}: {e}"


def _jax_library():
    """(path, None) when the JAX op library is there and loads, (path,
    why not) otherwise."""
    path = os.path.join(_capi.NATIVE_DIR, "_kerasdist_jax.so")
    if not os.path.exists(path):
        return path, "not built"
    try:
        _capi.lib()  # the core first: the JAX library links against it
        ctypes.CDLL(path)
    except OSError as e:
        return path, f"does not load: {e}"
    return path, None


def jax_check(jax_version, library):
    """(status, message) for the JAX front end: `jax_version` installed
    (or None), `library` as _jax_library() gives it."""
    path, problem = library
    if jax_version is None:
        if problem is None:
            return (INFO, "JAX op library built; jax is not installed "
                          "(only needed for KERAS_BACKEND=jax)")
        return (INFO, "jax is not installed (only needed for "
                      "KERAS_BACKEND=jax)")
    if problem == "not built":
        return (FAIL, f"jax {jax_version} is installed but kerasdist's JAX "
                      f"op library was not built ({path}): rebuild with "
                      "`pip install --no-build-isolation -e .` now that jax "
                      "is there.")
    if problem is not None:
        return (FAIL, f"the JAX op library {path} {problem}: rebuild with "
                      "`pip install --no-build-isolation -e .`.")
    return (OK, f"jax {jax_version} and its op library")


def torch_check(torch_version):
    """(status, message) for the PyTorch front end, which needs nothing
    built: `torch_version` installed, or None."""
    if torch_version is None:
        return (INFO, "PyTorch is not installed (only needed for "
                      "KERAS_BACKEND=torch: pip install "
                      "--no-build-isolation -e '.[torch]')")
    return (OK, f"PyTorch {torch_version} (kerasdist.torch needs nothing "
                "built)")


def backend_check(backend, where, version):
    """(status, message) for the Keras backend scripts will run on:
    `backend` chosen by `where`, its framework's `version` (or None)."""
    install = {"jax": "pip install \"jax[cpu]==0.10.2\" && pip install "
                      "--no-build-isolation -e '.[jax]'",
               "torch": "pip install --no-build-isolation -e '.[torch]'",
               "tensorflow": "pip install -r requirements.txt"}
    if backend not in install:
        return (FAIL, f"Keras backend {backend!r} (from {where}): kerasdist "
                      "runs on tensorflow, jax and torch; set KERAS_BACKEND "
                      "to one of them.")
    if version is None:
        return (FAIL, f"Keras backend {backend} (from {where}), but "
                      f"{backend} is not installed: {install[backend]}.")
    return (OK, f"Keras backend {backend} {version} (from {where})")


def _gpus():
    """GPU names from `nvidia-smi -L`, or None when nvidia-smi is absent."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [l for l in out.splitlines() if l.startswith("GPU ")]


# ---- check-build ------------------------------------------------------------

def check_build_rows():
    """(name, value) rows of `kerasdist check-build`."""
    info, err = _native_info()
    tf_running, _ = _version("tensorflow")
    keras, _ = _version("keras")
    rows = [("kerasdist", kerasdist.__version__),
            ("native library", info.get("kerasdist", "?") if info
             else f"not loadable ({err})"),
            ("TensorFlow built for", _built_for() or "unknown"),
            ("TensorFlow running", tf_running or "not installed"),
            ("Keras", keras or "not installed"),
            ("JAX built for", _built_for("jax") or "unknown"),
            ("JAX running", _version("jax")[0] or "not installed"),
            ("JAX op library", _jax_library()[1] or "built"),
            ("Python", sys.version.split()[0])]
    rows.append(("MPI built against", site_mpi.describe(site_mpi.record())))
    if info:
        rows += [("MPI library", info.get("mpi_library", "?")),
                 ("MPI standard", info.get("mpi_standard", "?"))]
        nccl = info.get("nccl") == "1"
        backend = info.get("gpu_backend", "")
        rows.append(("NCCL", f"yes ({backend})" if nccl else "no"))
        cuda = [p.split()[-1] for p in backend.split(",") if "CUDA" in p]
        rows.append(("CUDA", cuda[0] if cuda else "no"))
    return rows


def check_build(argv=None):
    """`kerasdist check-build`: prints the build table; 1 if unloadable."""
    argparse.ArgumentParser(
        prog="kerasdist check-build",
        description="Print what kerasdist's native library was built with."
    ).parse_args(argv)
    rows = check_build_rows()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if _native_info()[0] else 1


# ---- the self-test (runs on every rank under the launcher) ------------------

def selftest():
    """Every collective on numpy arrays through the C API, checked exactly.

    Inputs are `rank * 1000 + i`, so sums are exact in float32. Prints
    `selftest OK` on success; any failure or mismatch raises (exit 1).
    """
    import numpy as np

    from kerasdist import basics
    from kerasdist.rendezvous import conventions

    lib = _capi.lib()
    # kd.init(): under any launch convention (docs/platforms.md), not only
    # under the launcher.
    launch = conventions.detect(os.environ)
    basics.init()
    rank, size = lib.kerasdist_rank(), lib.kerasdist_size()
    started = basics.started_line(launch)
    f32 = _capi.dtype_codes()["float32"]
    sum_op, avg_op = _capi.reduce_ops()["Sum"], _capi.reduce_ops()["Average"]

    def ptr(a):
        return a.ctypes.data if a.size else None

    def run(op, name, x, out=None, **kw):
        h = _capi.Handle(op, name, f32, x.shape, ptr(x),
                         None if out is None else ptr(out), **kw)
        h.wait(timeout=60)
        return h

    def owned(h):
        p, shape = h.output()
        res = np.empty(shape, np.float32)
        if res.size:
            import ctypes
            ctypes.memmove(res.ctypes.data, p, res.nbytes)
        return res

    def mine(r, n):
        return (r * 1000 + np.arange(n)).astype(np.float32)

    n = 1000
    everyone = sum(mine(r, n) for r in range(size))
    out = np.empty(n, np.float32)
    run(_capi.OP_ALLREDUCE, "doctor.sum", mine(rank, n), out, reduce_op=sum_op)
    np.testing.assert_array_equal(out, everyone, "allreduce sum")
    xs = [mine(rank, n + k) for k in range(4)]
    outs = [np.empty_like(x) for x in xs]
    handles = [_capi.Handle(_capi.OP_ALLREDUCE, f"doctor.fused.{k}", f32,
                            x.shape, ptr(x), ptr(o), reduce_op=avg_op)
               for k, (x, o) in enumerate(zip(xs, outs))]
    for h in handles:
        h.wait(timeout=60)
    for k, o in enumerate(outs):
        want = sum(mine(r, n + k) for r in range(size)) / np.float32(size)
        np.testing.assert_allclose(o, want, rtol=1e-6, err_msg="average")
    g = owned(run(_capi.OP_ALLGATHER, "doctor.gather", mine(rank, rank + 1)))
    want = np.concatenate([mine(r, r + 1) for r in range(size)])
    np.testing.assert_array_equal(g, want, "allgather (uneven)")
    for root in range(size):
        b = np.empty(n, np.float32)
        run(_capi.OP_BROADCAST, f"doctor.bcast.{root}", mine(rank, n), b,
            root_rank=root)
        np.testing.assert_array_equal(b, mine(root, n), "broadcast")
    a = owned(run(_capi.OP_ALLTOALL, "doctor.alltoall",
                  np.repeat(mine(rank, size), 2)))
    np.testing.assert_array_equal(
        a, np.repeat([r * 1000 + rank for r in range(size)], 2)
        .astype(np.float32), "alltoall")
    rs = owned(run(_capi.OP_REDUCESCATTER, "doctor.rs", mine(rank, 2 * size),
                   reduce_op=sum_op))
    total = sum(mine(r, 2 * size) for r in range(size))
    np.testing.assert_array_equal(rs, total[2 * rank:2 * rank + 2],
                                  "reducescatter")
    h = _capi.Handle(_capi.OP_BARRIER, "doctor.barrier",
                     _capi.dtype_codes()["uint8"], (), None, None)
    h.wait(timeout=60)
    # A 1 MiB allreduce takes the single-node path when there is one: say
    # which (in-place reads, shared-memory slots, or MPI).
    big = 1 << 18
    before = (_capi.backend_runs("shm"), _capi.backend_runs("cma"))
    out = np.empty(big, np.float32)
    run(_capi.OP_ALLREDUCE, "doctor.large", mine(rank, big), out,
        reduce_op=sum_op)
    np.testing.assert_array_equal(out, sum(mine(r, big) for r in range(size)),
                                  "allreduce 1 MiB")
    shm = _capi.backend_runs("shm") - before[0]
    cma = _capi.backend_runs("cma") - before[1]
    path = "in place" if cma else "slots" if shm else "MPI"
    backends = lib.kerasdist_backends().decode()
    basics.shutdown()
    print(f"rank {rank}/{size}: {started}", flush=True)
    print(f"rank {rank}/{size}: backends, first enabled wins: {backends}",
          flush=True)
    print(f"rank {rank}/{size}: large allreduce path: {path}", flush=True)
    print(f"rank {rank}/{size}: selftest OK", flush=True)
    return 0


# ---- doctor -----------------------------------------------------------------

def install_checks(np_ranks):
    """[(status, message)] for everything but the self-test."""
    out = []
    info, err = _native_info()
    if info is None:
        out.append((FAIL, f"native library: {err}"))
    else:
        out.append((OK, f"native library {info.get('kerasdist')} loads"))
    built, running = _built_for(), _version("tensorflow")[0]
    if running is None:
        out.append((FAIL, "TensorFlow is not importable: pip install -r "
                          "requirements.txt (tensorflow-cpu or tensorflow "
                          f"{built or '2.21.*'})."))
    elif built is None:
        out.append((FAIL, f"TensorFlow {running} runs but the op library was "
                          "never built for it: pip install "
                          "--no-build-isolation -e . (or make -C ops)."))
    elif built != running:
        out.append((FAIL, _build_check.mismatch(
            "tensorflow", built, running,
            _build_check.installed("tensorflow")[0])))
    else:
        out.append((OK, f"TensorFlow {running} (the op library's build)"))
    keras = _version("keras")[0]
    if keras is None or not keras.startswith("3."):
        out.append((FAIL, f"Keras 3 is needed, found {keras or 'none'}: "
                          "pip install 'keras>=3.8,<4'."))
    else:
        out.append((OK, f"Keras {keras}"))
    out.append(jax_check(_version("jax")[0], _jax_library()))
    jax_mismatch = _build_check.mismatch("jax", _built_for("jax"),
                                         _version("jax")[0])
    if jax_mismatch:
        out.append((WARN, jax_mismatch))
    out.append(torch_check(_version("torch")[0]))
    backend, where = active_backend(os.environ)
    out.append(backend_check(
        backend, where,
        _version(backend)[0] if backend in _DISTRIBUTIONS else None))
    out += mpi_checks(info, site_mpi.record(), os.environ)
    try:
        from kerasdist.run import mpi_command
        out.append((OK, f"launcher: {mpi_command.find_mpiexec()}"))
    except Exception as e:  # noqa: BLE001 - its message says what to do
        out.append((FAIL, f"launcher: {e}"))
    out.append(launch_check(os.environ))
    out += gpu_checks(info, _gpus(), np_ranks)
    if info is not None:
        settings, err = _settings()
        if settings is None:
            out.append((FAIL, f"settings: {err} init() would fail; fix or "
                              "unset that variable."))
        else:
            out.append(shm_check(_shm_free("/dev/shm"), np_ranks,
                                 settings[_shm_name()]))
    out.append(huge_pages_check(_thp_mode(), platform.libc_ver()))
    return out


def mpi_checks(info, rec, environ):
    """The MPI kerasdist was built against (the build record), the one it
    loads at run time (MPI_Get_library_version through the C API, in
    `info`), and whether this process's MPI launcher suits the build
    (kerasdist/_core/site_mpi.py)."""
    out = [(OK if rec else WARN,
            f"MPI built against: {site_mpi.describe(rec)}"
            + (f", {rec['library_path']}" if rec.get("library_path") else "")
            if rec else "MPI built against: not recorded (a build older "
            "than the record; rebuild to have it)")]
    if info is None:
        return out
    loaded = info.get("mpi_library", "?")
    wrong = site_mpi.check_loaded(loaded, rec)
    out.append((FAIL, wrong) if wrong else
               (OK, f"MPI loaded: {loaded} (MPI {info.get('mpi_standard')})"))
    wrong = site_mpi.check_launch(environ, rec)
    if wrong:
        out.append((FAIL, wrong))
    return out


def launch_check(environ):
    """The launch convention line: what kd.init() would find in `environ`
    (docs/platforms.md, "Without `kerasdist run`")."""
    from kerasdist.rendezvous import conventions
    try:
        launch = conventions.detect(environ)
    except ValueError as e:
        return FAIL, f"launch convention: {e}"
    if launch.convention == "single":
        return INFO, ("launch convention single: no launcher's or "
                      "platform's variables here, kd.init() starts a job of "
                      "one (the self-test runs under kerasdist run)")
    if launch.coordinator is None:
        how = ("MPI starts from its launcher" if launch.convention == "mpi"
               else "a job of one, no coordinator")
    else:
        how = "kd.init() meets the other processes at the coordinator"
    return OK, f"{conventions.describe(launch)} ({how})"


_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode():
    """The kernel's transparent huge page mode ("always", "madvise",
    "never"), or None where the kernel has none."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def huge_pages_check(mode, libc):
    """The huge pages line. `kerasdist run` starts ranks with
    glibc.malloc.hugetlb=1 so that TensorFlow's large tensors sit on 2 MiB
    pages (docs/launcher.md); that needs glibc 2.35+ and a kernel whose
    transparent huge pages are "madvise" or "always". `libc` is
    platform.libc_ver()'s (name, version)."""
    name, version = libc
    if mode is None or mode == "never":
        return (INFO, f"transparent huge pages are {mode or 'absent'} here: "
                      "large tensors stay on 4 KiB pages (the single-node "
                      "allreduce of large tensors is then slower).")
    if name != "glibc":
        return (INFO, f"C library {name or 'unknown'}: its malloc does not "
                      "take glibc.malloc.hugetlb; large tensors may stay on "
                      "4 KiB pages.")
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if parts < (2, 35):
        return (INFO, f"glibc {version} predates glibc.malloc.hugetlb (2.35): "
                      "large tensors stay on 4 KiB pages under kerasdist run.")
    return (OK, f"huge pages: kernel THP '{mode}', glibc {version}: kerasdist "
                "run puts malloc's memory on them (--no-huge-pages: off)")


def _shm_name():
    return _capi.setting_name("shm_allreduce")


def _settings():
    """(the settings init() would run with here, None), or (None, the
    core's message about a malformed KERASDIST_* variable)."""
    try:
        return _capi.resolve_settings(), None
    except ValueError as e:
        return None, str(e)


def _shm_free(path):
    """Free bytes on `path`, or None when it is not there."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# The runtime's largest shared-memory slot per rank (ops/core/runtime.cc).
_SHM_SLOT_MAX = 64 << 20


def shm_check(free, np_ranks, setting):
    """The shared-memory allreduce line. Each local rank maps a slot as large
    as its largest allreduce, at most 64 MiB (bigger tensors go through in
    pieces); when the slots do not fit in /dev/shm the ranks use MPI for
    those sizes."""
    # `setting` is the variable's text; the core says what it means.
    if _capi.parse_setting(_shm_name(), setting) == "0":
        return (INFO, f"shared-memory allreduce off ({_shm_name()}="
                      f"{setting}): single-node allreduces use MPI.")
    if free is None:
        return (WARN, "no /dev/shm: single-node allreduces will use MPI "
                      "(slower for large tensors). Mount a tmpfs there.")
    need = np_ranks * _SHM_SLOT_MAX
    mib = free / (1 << 20)
    if free < need:
        return (WARN, f"/dev/shm has {mib:.0f} MiB free, less than "
                      f"{np_ranks} ranks x {_SHM_SLOT_MAX >> 20} MiB: the "
                      "largest allreduces will fall back to MPI (slower). "
                      "In Docker, run with --shm-size=1g or more.")
    return (OK, f"shared-memory allreduce: /dev/shm has {mib:.0f} MiB free")


def gpu_checks(info, gpus, np_ranks):
    """NCCL/GPU lines from build info and `nvidia-smi -L` (None: absent)."""
    nccl = bool(info) and info.get("nccl") == "1"
    out = []
    if nccl:
        out.append((OK, f"GPU backend: {info.get('gpu_backend')}"))
    if gpus is None:
        out.append((INFO, "no nvidia-smi: no NVIDIA GPU here, CPU training "
                          "only" + (" (NCCL is built but unused)." if nccl
                                    else ".")))
        return out
    if not gpus:
        out.append((WARN if nccl else INFO,
                    "nvidia-smi lists no GPU; check the driver "
                    "(nvidia-smi) if this machine should have one."))
        return out
    if not nccl:
        out.append((WARN, f"{len(gpus)} GPU(s) here but kerasdist was built "
                          "without NCCL: GPU tensors are rejected. Rebuild "
                          "with KERASDIST_WITH_NCCL=1 pip install "
                          "--no-build-isolation -e . (needs nvcc and "
                          "pip install nvidia-nccl-cu13)."))
    per = len(gpus) / np_ranks
    if len(gpus) < np_ranks:
        out.append((WARN, f"{len(gpus)} GPU(s) for {np_ranks} ranks on this "
                          "machine: ranks would share a GPU, which NCCL "
                          "refuses. Run at most one rank per GPU, or set "
                          "KERASDIST_GPU_OPERATIONS=MPI."))
    else:
        out.append((OK, f"{len(gpus)} GPU(s), {per:g} per local rank at "
                        f"-np {np_ranks}: pin with tf.config.set_visible_"
                        "devices(gpus[kd.local_rank()], 'GPU')."))
    return out


def selftest_check(np_ranks, timeout):
    """Runs the self-test under the launcher; (status, message)."""
    argv = [sys.executable, "-m", "kerasdist.run", "-np", str(np_ranks),
            "--timeout", str(timeout), sys.executable, "-m",
            "kerasdist.tools.doctor", "--selftest"]
    try:
        p = subprocess.run(argv, capture_output=True, text=True,
                           timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return FAIL, (f"{np_ranks}-rank self-test did not finish in "
                      f"{timeout + 30:g} s; run `{' '.join(argv[1:])}` to see "
                      "where it hangs.")
    passed = p.stdout.count("selftest OK")
    if p.returncode == 0 and passed == np_ranks:
        return OK, (f"{np_ranks}-rank self-test: allreduce, fused allreduce, "
                    "allgather, broadcast, alltoall, reducescatter, barrier; "
                    + _path_note(p.stdout, np_ranks)
                    + _backends_note(p.stdout, np_ranks))
    tail = (p.stdout + p.stderr).strip().splitlines()[-6:]
    return FAIL, (f"{np_ranks}-rank self-test failed (exit {p.returncode}); "
                  "the launcher's last lines:\n      " + "\n      ".join(tail))


_PATHS = {
    "in place": "large single-node allreduces read the other ranks' tensors "
                "in place (cross-memory attach)",
    "slots": "large single-node allreduces go through shared-memory slots "
             "(in-place reads are not allowed here, e.g. by a seccomp "
             "profile, or KERASDIST_CMA_ALLREDUCE=0)",
    "MPI": "large allreduces use MPI (ranks on several hosts, or "
           "KERASDIST_SHM_ALLREDUCE=0, or /dev/shm too small)",
}


def _path_note(stdout, np_ranks):
    """What the self-test's 1 MiB allreduce took, from rank 0's line."""
    for line in stdout.splitlines():
        if f"0/{np_ranks}: large allreduce path: " in line:
            path = line.rsplit(": ", 1)[1].strip()
            if np_ranks == 1:
                return "one rank: nothing to reduce across ranks"
            return _PATHS.get(path, path)
    return "path of large allreduces not reported"


def _backends_note(stdout, np_ranks):
    """The data path's backend list, from rank 0's line."""
    for line in stdout.splitlines():
        if f"0/{np_ranks}: backends, first enabled wins: " in line:
            names = line.rsplit(": ", 1)[1].strip()
            return f"; backends, first enabled wins: {names}"
    return ""


def doctor(argv=None):
    """`kerasdist doctor`: prints each check; returns 1 if any failed."""
    p = argparse.ArgumentParser(
        prog="kerasdist doctor",
        description="Check this kerasdist install and run a multi-rank "
                    "self-test of every collective.")
    p.add_argument("--np", type=int, default=2, dest="np_ranks",
                   help="ranks for the self-test and the GPU count check")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds the self-test may take (default 120)")
    p.add_argument("--no-selftest", action="store_true",
                   help="only the install checks")
    p.add_argument("--selftest", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.selftest:
        return selftest()
    results = install_checks(args.np_ranks)
    for status, message in results:
        print(f"{status:<4}  {message}", flush=True)
    if not args.no_selftest:
        if any(s == FAIL for s, _ in results[:1]):
            results.append((FAIL, "self-test skipped: the native library "
                                  "does not load."))
        else:
            results.append(selftest_check(args.np_ranks, args.timeout))
        print(f"{results[-1][0]:<4}  {results[-1][1]}", flush=True)
    failed = sum(s == FAIL for s, _ in results)
    print(f"# {failed} problem(s)" if failed else "# all checks passed")
    return 1 if failed else 0


def main(argv=None):
    return doctor(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
