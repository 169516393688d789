"""kerasdist built against Intel MPI (the impi-devel and impi-rt wheels, in a
prefix of their own) and started by Intel's own launchers: its
mpiexec.hydra across two test hosts and on one, `kerasdist run` with
KERASDIST_MPI_HOME pointing at it, and Slurm's `srun --mpi=pmi2`; every
collective against numpy, a Keras fit whose weights equal the mpich build's
bit for bit, and both builds on the other one's libmpi (the MPICH ABI,
libmpi.so.12).

Intel MPI is looked for in $KERASDIST_TEST_INTEL_MPI, else .impi in the
repository (`make test` installs it there: `pip install --no-deps --prefix .impi
impi-devel==2021.19.0 impi-rt==2021.19.0`); Debian's libfabric1 is its
fabric library and libpmi2-0 Slurm's PMI-2 library. The build goes to a
temporary directory once per module; it reuses the editable build's
objects that do not see mpi.h (TensorFlow's and JAX's), so only the core
is compiled (KERASDIST_TEST_INTEL_BUILD=DIR: use the build in DIR/kerasdist
instead, made the same way, to rerun the tests without building).
"""

import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import kerasdist
from tests.support import slurm as slurm_lib
from tests.support import system
from tests.support.cluster import Cluster
from tests.support.cluster import require
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import kill_tree
from tests.support.helpers import launch
from tests.support.helpers import rank_lines
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

pytestmark = pytest.mark.cluster

PMI2 = "/usr/lib/x86_64-linux-gnu/libpmi2.so.0"  # Debian's libpmi2-0
WHEEL_LIB = os.path.join(sys.prefix, "lib")  # the mpich wheel's libmpi


def _missing(message):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def _intel_home():
    home = os.environ.get("KERASDIST_TEST_INTEL_MPI") or os.path.join(
        REPO_ROOT, ".impi")
    if not os.path.exists(os.path.join(home, "include", "mpi.h")) or \
            not os.path.exists(os.path.join(home, "bin", "impi_info")):
        _missing(f"no Intel MPI in {home} (pip install --no-deps --prefix "
                 f"{home} impi-devel==2021.19.0 impi-rt==2021.19.0, or set "
                 "KERASDIST_TEST_INTEL_MPI)")
    return home


def _build(home, dest):
    """kerasdist's package with native libraries built against the MPI in
    `home`, in dest/kerasdist (its Python files are links to the tree's)."""
    src = os.path.join(REPO_ROOT, "kerasdist")
    pkg = os.path.join(dest, "kerasdist")
    os.makedirs(pkg)
    for name in os.listdir(src):
        if name.endswith(".so") or name in ("_build_info.json",
                                            ".kerasdist_obj", "__pycache__"):
            continue
        os.symlink(os.path.join(src, name), os.path.join(pkg, name))
    out = subprocess.run(
        ["make", "-C", os.path.join(REPO_ROOT, "ops"), "-j2",
         f"OUT={pkg}", f"OBJ_DIR={os.path.join(src, '.kerasdist_obj')}",
         f"KERASDIST_MPI_HOME={home}", f"PYTHON={sys.executable}",
         f"VERSION={kerasdist.__version__}"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return dest


@pytest.fixture(scope="module")
def site():
    """(Intel MPI's prefix, the Intel build's directory, cluster, Slurm or
    None)."""
    require()
    home = _intel_home()
    system.require("libfabric1")
    with tempfile.TemporaryDirectory(prefix="kerasdist-impi-") as tmp, \
            Cluster(2) as c:
        build = os.environ.get("KERASDIST_TEST_INTEL_BUILD") or _build(
            home, tmp)
        s = None
        if slurm_lib.unavailable_reason() is None and os.path.exists(PMI2):
            s = slurm_lib.Slurm(c)
        try:
            yield home, build, c, s
        finally:
            # The hosts first: their slurmds go with them at once (a
            # SIGTERM to nsenter does not reach them; Slurm.close() would
            # wait 10 s for each).
            c.close()
            if s is not None:
                s.close()


def _env(build=None, **extra):
    """Ranks' environment: the worker's; with `build` (a directory holding
    a kerasdist package) the worker imports that one."""
    env = worker_env(**extra)
    if build is not None:
        env["SITE_MPI_BUILD"] = build
    return env


def _run(argv, env, timeout=120, prefix=()):
    proc = subprocess.Popen([*prefix, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=env, cwd=REPO_ROOT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{argv} ran past {timeout} s:\n{out[-4000:]}")
    kill_tree(proc)
    return proc.returncode, out


def _mpi_libs(out):
    """{libmpi path: its version line} from the worker's MPI_LIB lines."""
    found = {}
    for line in out.splitlines():
        if line.split("]:")[-1].startswith("MPI_LIB "):
            path, version = line.split("MPI_LIB ", 1)[1].split(" | ", 1)
            found[path] = version
    return found


def _packages(out):
    """The directories the ranks imported kerasdist from."""
    return {l.split("PACKAGE ", 1)[1] for l in out.splitlines()
            if l.split("]:")[-1].startswith("PACKAGE ")}


def _topo_hosts(out):
    """The hosts the ranks' TOPO lines name, sorted."""
    return sorted(re.findall(r"^TOPO rank=\d+ .*?host=(\S+)$", out, re.M))


def _collectives_passed(out, np_):
    assert out.count("OK allreduce_path") == np_, out[-4000:]
    assert out.count("DONE") == np_, out[-4000:]


def test_intel_hydra_on_one_host_and_each_build_on_the_others_libmpi(site):
    """mpiexec -n 2 on this machine: the Intel build under Intel's
    mpiexec.hydra; the mpich-wheel build on Intel's libmpi
    (LD_LIBRARY_PATH) under Intel's; the Intel build on the wheel's libmpi
    under the wheel's mpiexec. Either libmpi.so.12 serves either build.
    Then `kerasdist run --bind-to none` with Intel's mpiexec: no rank is
    pinned."""
    home, build, _, _ = site
    cmd = worker_cmd("site_mpi_worker.py", "--collectives")
    intel = os.path.join(home, "lib")
    runs = [  # (what, build, LD_LIBRARY_PATH, the MPI that must run it)
        ("intel build", build, None, intel),
        ("mpich build on intel's libmpi", None, intel, intel),
        ("intel build on the wheel's libmpi", build, WHEEL_LIB, WHEEL_LIB),
    ]
    for what, pkg, ld_path, lib in runs:
        env = _env(pkg)
        if ld_path:
            env["LD_LIBRARY_PATH"] = ld_path
        mpiexec = os.path.join(os.path.dirname(lib), "bin",
                               "mpiexec.hydra" if lib == intel else "mpiexec")
        code, out = _run([mpiexec, "-n", "2", *cmd], env)
        assert code == 0, (what, out[-4000:])
        _collectives_passed(out, 2)
        assert _packages(out) == {pkg or REPO_ROOT}, (what, out[-2000:])
        libs = _mpi_libs(out)
        assert {os.path.dirname(p) for p in libs} == {lib}, (what, libs)
        name = "Intel(R) MPI Library 2021.19.0" if lib == intel else "MPICH"
        assert all(name in v for v in libs.values()), (what, libs)
    # kerasdist run --bind-to none under Intel's mpiexec: Intel MPI's own
    # pinning (I_MPI_PIN) is off, so each rank may run on every CPU.
    result = launch(2, worker_cmd("site_mpi_worker.py"), timeout=120,
                    env=_env(build, KERASDIST_MPI_HOME=home),
                    launcher_args=["--bind-to", "none"])
    assert result.returncode == 0, result.stdout[-3000:]
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    for r in range(2):
        assert f"CPUS {every}" in rank_lines(result.stdout, r), (
            r, result.stdout[-2000:])


def test_intel_hydra_across_hosts(site):
    """Intel's mpiexec.hydra -hosts kdt0,kdt1 -ppn 1, over its TCP fabric
    (libfabric's tcp provider; nothing to set), with the Intel build."""
    home, build, c, _ = site
    intel_lib = os.path.join(home, "lib")
    hydra = os.path.join(home, "bin", "mpiexec.hydra")
    code, out = _run(
        [hydra, "-launcher", "ssh", "-launcher-exec", c.remote_shell,
         "-iface", c.bridge, "-hosts", "kdt0,kdt1", "-ppn", "1", "-n", "2",
         *worker_cmd("site_mpi_worker.py", "--collectives")],
        _env(build), prefix=c.launcher_prefix())
    assert code == 0, out[-4000:]
    _collectives_passed(out, 2)
    assert _topo_hosts(out) == ["kdt0", "kdt1"], out[-3000:]
    assert {os.path.dirname(p) for p in _mpi_libs(out)} == {intel_lib}
    assert _packages(out) == {build}, out[-2000:]


def test_kerasdist_run_with_intel_mpi_fits_as_the_mpich_build(site,
                                                               tmp_path):
    """`kerasdist run -H kdt0:1,kdt1:1` with KERASDIST_MPI_HOME at Intel MPI
    (its mpiexec; the hosts go in a machine file, see
    kerasdist/run/intel_mpi.py): every collective and a fit, whose weights
    equal bit for bit those of the same job on the mpich build."""
    home, build, c, _ = site
    weights = {}
    mpich_env = _env()
    mpich_env.pop("KERASDIST_MPI_HOME", None)  # the wheel's mpiexec
    for name, env in (("intel", _env(build, KERASDIST_MPI_HOME=home)),
                      ("mpich", mpich_env)):
        npz = tmp_path / f"{name}.npz"
        args = ["--collectives"] if name == "intel" else []
        result = launch(2, worker_cmd("site_mpi_worker.py", *args, "--fit",
                                      str(npz)), timeout=240, env=env,
                        launcher_args=["--ssh-command", c.remote_shell,
                                       "--network-interface", c.bridge,
                                       "-H", "kdt0:1,kdt1:1"],
                        prefix=c.launcher_prefix())
        assert result.returncode == 0, (name, result.stdout[-4000:])
        for r, host in enumerate(("kdt0", "kdt1")):
            lines = rank_lines(result.stdout, r)
            assert "OK fit" in lines, (name, r, lines[-20:])
            topo = [l for l in lines if l.startswith("TOPO ")]
            assert topo == [f"TOPO rank={r} size=2 local_rank=0 "
                            f"local_size=1 host={host}"], (name, topo)
            lib = [l for l in lines if l.startswith("MPI_LIB ")][0]
            assert ("Intel(R) MPI" in lib) == (name == "intel"), lib
            if name == "intel":
                assert "OK allreduce_path" in lines and "DONE" in lines
        with np.load(npz) as f:
            weights[name] = [f[k] for k in sorted(f.files)]
    assert len(weights["intel"]) == len(weights["mpich"]) == 4
    for a, b in zip(weights["intel"], weights["mpich"]):
        assert np.array_equal(a, b), (a, b)


def test_srun_pmi2_with_the_intel_build(site):
    """`srun --mpi=pmi2` starts the Intel build's ranks on both hosts; Intel
    MPI talks PMI-2 to slurmd through Slurm's libpmi2
    (I_MPI_PMI_LIBRARY)."""
    home, build, c, s = site
    system.require("libpmi2-0", *slurm_lib.PACKAGES)
    assert s is not None  # the fixture makes Slurm where its packages are
    env = s.env(_env(build, I_MPI_PMI_LIBRARY=PMI2))
    code, out = _run(s.prefix() + [
        "salloc", "-N2", "-n2", "srun", "--mpi=pmi2",
        *worker_cmd("site_mpi_worker.py", "--collectives")], env)
    s.wait_jobs_done()  # the hosts' step daemons end with the test
    assert code == 0, out[-4000:]
    _collectives_passed(out, 2)
    assert _topo_hosts(out) == ["kdt0", "kdt1"], out[-3000:]
    assert {os.path.dirname(p) for p in _mpi_libs(out)} == {
        os.path.join(home, "lib")}
    assert _packages(out) == {build}, out[-2000:]
