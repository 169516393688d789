"""The MPI launcher's command line for one attempt of `kerasdist run`.

`find_mpiexec` finds the launcher (hydra's mpiexec, or the mpirun of the
MPI kerasdist was built against); `build_mpiexec_argv` builds hydra's
command line (Intel MPI's with a machinefile) and `build_openmpi_argv`
Open MPI's, both ending in the per-rank wrapper (`rank_wrapper_argv`,
_rank.py) and the user's command. `mpiexec_argv` and `wrapper_options`
take those options from a LaunchConfig (launch_config.py).

Standard library only (see launch.py).
"""

import os
import shutil
import sys

from kerasdist._core import site_mpi
from kerasdist.run import _rank
from kerasdist.run import elastic
from kerasdist.run import hosts as hosts_lib
from kerasdist.run import settings


def find_mpiexec(environ=None, prefix=None, which=shutil.which):
    """Finds the MPI launcher.

    Looks at $KERASDIST_MPI_HOME/bin/mpiexec, then <sys.prefix>/bin/mpiexec
    (the mpich wheel), then mpiexec on PATH.

    Returns:
        The path of mpiexec.

    Raises:
        FileNotFoundError: with a message that says where it looked.
    """
    environ = os.environ if environ is None else environ
    prefix = sys.prefix if prefix is None else prefix
    rec = site_mpi.record()
    if site_mpi.vendor(rec).family != "hydra":
        # Built against another MPI (Open MPI): its own launcher.
        path = site_mpi.launcher_path(rec, environ, prefix)
        if path is None:
            raise FileNotFoundError(
                f"kerasdist was built against {site_mpi.describe(rec)} but "
                f"its {site_mpi.vendor(rec).launcher} is not in "
                f"{rec.get('launcher_dir') or 'the build record'} nor on "
                f"PATH; set {settings.MPI_HOME} to that MPI's prefix")
        return path
    home = environ.get(settings.MPI_HOME)
    if home:
        path = os.path.join(home, "bin", "mpiexec")
        if os.access(path, os.X_OK):
            return path
        raise FileNotFoundError(
            f"{settings.MPI_HOME}={home!r} but {path} is not an executable")
    path = os.path.join(prefix, "bin", "mpiexec")
    if os.access(path, os.X_OK):
        return path
    found = which("mpiexec", path=environ.get("PATH"))
    if found:
        return found
    raise FileNotFoundError(
        f"no mpiexec found: not in {os.path.join(prefix, 'bin')} nor on PATH. "
        f"Install MPI (`pip install mpich`) or set {settings.MPI_HOME} to "
        "an MPI installation's prefix")


def rank_wrapper_argv(no_prefix=False, python=None, bind=False,
                      report_bind=False, huge_pages=False):
    """The per-rank wrapper's command line, ending with "--"."""
    wrapper = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "_rank.py")
    argv = [python or sys.executable, "-I", "-S", wrapper]
    if no_prefix:
        argv.append("--no-prefix")
    if bind:
        argv.append("--bind")
    if report_bind:
        argv.append("--report-bind")
    if huge_pages:
        argv.append("--huge-pages")
    return argv + ["--"]


def build_mpiexec_argv(mpiexec, np, command, rank_env, hosts=None,
                       no_prefix=False, python=None, bind=False,
                       report_bind=False, launcher_exec=None, iface=None,
                       huge_pages=False, machinefile=None):
    """Builds the hydra mpiexec command line.

    Args:
        mpiexec: path of mpiexec.
        np: number of ranks.
        command: the user's command (a list).
        rank_env: KERASDIST_* variables for every rank, passed with -genv so
            they reach remote hosts too.
        hosts: [(host, slots), ...] or None for this machine.
        no_prefix: ask the wrapper not to prefix output lines.
        python: the interpreter for the wrapper (default sys.executable).
        bind: ask the wrapper to bind each rank to its share of the CPUs.
        report_bind: ask the wrapper to print each rank's binding.
        launcher_exec: the remote shell executable (hydra's -launcher-exec),
            or None for hydra's default (ssh).
        iface: the network interface hydra advertises to the other hosts,
            or None.
        huge_pages: ask the wrapper to back each rank's malloc by huge
            pages (see _rank.with_huge_pages).
        machinefile: a file naming `hosts` (intel_mpi.write_machinefile),
            given as `-machinefile` instead of `-hosts` (Intel MPI's
            mpiexec, see intel_mpi.py).

    Returns:
        The argv list.
    """
    if site_mpi.vendor(site_mpi.record()).family == "openmpi":
        return build_openmpi_argv(mpiexec, np, command, rank_env, hosts,
                                  no_prefix, python, bind, report_bind,
                                  launcher_exec, iface, huge_pages)
    argv = [mpiexec, "-genvall"]
    for name, value in rank_env.items():
        argv += ["-genv", name, value]
    if hosts and machinefile:
        argv += ["-machinefile", machinefile]
    elif hosts:
        argv += ["-hosts", hosts_lib.hydra_hosts_arg(hosts)]
    if launcher_exec:
        argv += ["-launcher", "ssh", "-launcher-exec", launcher_exec]
    if iface:
        argv += ["-iface", iface]
    argv += ["-n", str(np)]
    return argv + rank_wrapper_argv(no_prefix, python, bind, report_bind,
                                    huge_pages) + list(command)


# Variables of the launcher's environment not passed on to the ranks by
# Open MPI's -x: the launchers' own, and shell functions.
_NOT_EXPORTED = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "OPAL_", "BASH_FUNC",
                 "SLURM_")


def interface_network(name):
    """The IPv4 network ("198.18.0.0/24") of interface `name`."""
    import fcntl
    import ipaddress
    import socket
    import struct
    address = elastic.interface_address(name)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x891B,  # SIOCGIFNETMASK
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ValueError(f"--network-interface {name}: no IPv4 netmask "
                             f"({e.strerror or e})") from None
    mask = socket.inet_ntoa(packed[20:24])
    return str(ipaddress.ip_network(f"{address}/{mask}", strict=False))


def build_openmpi_argv(mpirun, np, command, rank_env, hosts=None,
                       no_prefix=False, python=None, bind=False,
                       report_bind=False, launcher_exec=None, iface=None,
                       huge_pages=False, environ=None):
    """Open MPI's mpirun command line for what build_mpiexec_argv builds
    for hydra: every variable of this environment and `rank_env` exported
    (-x, hydra's -genvall), -H for the hosts, as many ranks as asked on a
    host (--oversubscribe, as hydra does), no binding by mpirun (the
    wrapper's, as with hydra), the remote shell as Open MPI's
    plm_rsh_agent, the MPI's prefix on the remote hosts (--prefix), and
    --allow-run-as-root for root."""
    environ = os.environ if environ is None else environ
    # --bind-to none: the rank wrapper binds (--bind-to core), as with
    # hydra, which binds nothing itself; Open MPI would bind each rank
    # to one core first.
    argv = [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    if hosts:
        # The daemons stay children of their remote shells (as hydra's
        # proxies do), so that they end with the job.
        argv += ["-H", hosts_lib.hydra_hosts_arg(hosts),
                 "--leave-session-attached", "--prefix",
                 os.path.dirname(os.path.dirname(os.path.realpath(mpirun)))]
    if launcher_exec:
        argv += ["--mca", "plm_rsh_agent", launcher_exec]
    if iface:
        # The daemons on the other hosts read the same setting, where the
        # interface has another name: its network instead (a.b.c.d/n).
        net = interface_network(iface)
        argv += ["--mca", "btl_tcp_if_include", net,
                 "--mca", "oob_tcp_if_include", net]
    names = sorted(set(environ) | set(rank_env))
    for name in names:
        if name.isidentifier() and not name.startswith(_NOT_EXPORTED):
            argv += ["-x", name]
    return argv + rank_wrapper_argv(no_prefix, python, bind, report_bind,
                                    huge_pages) + list(command)


def wrapper_options(config):
    """rank_wrapper_argv's options as the LaunchConfig `config` asks."""
    return {"no_prefix": config.no_prefix, "bind": config.bind_to == "core",
            "report_bind": config.verbose,
            "huge_pages": not config.no_huge_pages}


def mpiexec_argv(config, mpiexec, np_, hosts, rank_env, launcher_exec=None,
                 machinefile=None):
    """build_mpiexec_argv for an attempt of `config` (a LaunchConfig) on
    np_ ranks and `hosts`; the other arguments as there."""
    argv = build_mpiexec_argv(mpiexec, np_, config.command, rank_env, hosts,
                              launcher_exec=launcher_exec,
                              iface=config.network_interface,
                              machinefile=machinefile,
                              **wrapper_options(config))
    if config.recover_in_place:
        argv = with_recovery(argv)
    return argv


RECOVER_ENV = _rank.RECOVER_ENV


def with_recovery(argv):
    """An Open MPI mpirun command line (build_openmpi_argv's) that keeps
    the survivors of a lost rank (--recover-in-place): ULFM's fault
    tolerance on (--with-ft ulfm), and every rank told to re-form in place
    (KERASDIST_RECOVER_IN_PLACE=1, passed with -x), and no barrier in
    MPI_Finalize (async_mpi_finalize): its PMIx fence spans every host of
    the job, and a host whose ranks were all lost never joins it, so the
    survivors would wait in it for ever (kerasdist's own shutdown already
    says goodbye to every rank)."""
    return [argv[0], "--with-ft", "ulfm", "-x", f"{RECOVER_ENV}=1",
            "--mca", "async_mpi_finalize", "1"] + list(argv[1:])
