"""`kerasdist run`: starts N ranks of a command under MPI's mpiexec (hydra).

    kerasdist run -np 4 python train.py
    kerasdist run -np 8 -H node1:4,node2:4 --fusion-threshold-mb 32 \\
        python train.py
    kerasdist run --nnodes 2 --node-rank 1 --master-addr node1 \\
        --nproc-per-node 4 python train.py

The last is node mode (node.py): run on every host, it starts that host's
ranks itself, without mpiexec or ssh.

Standard library only: never imports TensorFlow; from the rest of kerasdist
only the ctypes binding of the core library, for the settings' names (see
settings.py). It starts in milliseconds. See docs/launcher.md.
"""

import argparse
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time

from kerasdist.run import _rank
from kerasdist.run import elastic
from kerasdist.run import hosts as hosts_lib
from kerasdist.run import intel_mpi
from kerasdist.run import job
from kerasdist.run import node
from kerasdist.run import remote
from kerasdist.run import rendezvous
from kerasdist.run import site_mpi
from kerasdist.run import resize
from kerasdist.run import settings
from kerasdist.run import shm
from kerasdist.run import slurm

PROG = "kerasdist run"


class UsageError(Exception):
    """Bad command-line input; reported as `kerasdist run: error: ...`,
    exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}")
    return value


def _num_proc(text):
    # argparse reads "-np2" as "-n p2" (-n is -np's short form): take it
    # as the "-np 2" it means.
    if len(text) > 1 and text[0] == "p" and text[1:].isdigit():
        text = text[1:]
    return _positive_int(text)


def _non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a non-negative number, got {text!r}")
    return value


def _at_most(most, what):
    """A non-negative number up to `most` (a buffer of 10**308 MiB or a
    cycle of 10**12 ms is a typo, not a setting: one line, not a traceback
    or an init() that waits silently)."""
    def parse(text):
        value = _non_negative_float(text)
        if value > most:
            raise argparse.ArgumentTypeError(
                f"{text!r} is above {most:g}, the most {what}")
        return value
    return parse


def _positive_float(text):
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number, got {text!r}")
    return value


def _non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a non-negative integer, got {text!r}")
    return value


def make_parser():
    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Run COMMAND on N ranks under mpiexec, with "
                    "rank-prefixed output and fail-fast teardown.",
        epilog="Example: kerasdist run -np 2 python train.py",
    )
    p.add_argument("-np", "-n", "--num-proc", dest="np", type=_num_proc,
                   metavar="N", help="number of ranks (default inside a "
                   "Slurm allocation: its number of tasks)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS",
                       help="host1:slots,host2:slots (default: this machine)")
    where.add_argument("--hostfile", metavar="FILE",
                       help="file with one 'host slots=N' or 'host:N' a line")
    p.add_argument("--ssh-command", metavar="CMD",
                   default=os.environ.get(remote.SSH_COMMAND),
                   help="the remote shell that starts ranks on other hosts, "
                   "called like ssh: CMD HOST COMMAND (default: ssh, or "
                   f"${remote.SSH_COMMAND})")
    p.add_argument("--network-interface", metavar="IFACE",
                   help="the interface whose address the other hosts reach "
                   "this machine at (hydra's -iface; default: the address "
                   "of this machine's host name)")
    mode = p.add_argument_group(
        "node mode", "run on every host (the platform starts one launcher "
        "per host): each starts its host's ranks, no mpiexec, no ssh; "
        "torchrun's flags and spellings")
    mode.add_argument("--nnodes", metavar="N", help="number of hosts "
                      "(default 1)")
    mode.add_argument("--node-rank", "--node_rank", dest="node_rank",
                      metavar="I", help="this host's number, 0 to N-1 "
                      "(default 0); node 0 runs rank 0")
    mode.add_argument("--nproc-per-node", "--nproc_per_node",
                      dest="nproc_per_node", metavar="K",
                      help="ranks to start on this host (default 1)")
    mode.add_argument("--master-addr", "--master_addr", dest="master_addr",
                      metavar="HOST", help="node 0's host name or address, "
                      "where the ranks meet (required with --nnodes > 1)")
    mode.add_argument("--master-port", "--master_port", dest="master_port",
                      metavar="PORT", help="a free port on node 0's host "
                      f"(default {node.DEFAULT_PORT}; one node: any free "
                      "port)")
    p.add_argument("--fusion-threshold-mb",
                   type=_at_most(65536, "MiB a fusion buffer may have"),
                   metavar="MB", help="tensor fusion buffer size in MiB")
    p.add_argument("--cycle-time-ms",
                   type=_at_most(60000, "milliseconds a cycle may last"),
                   metavar="MS",
                   help="background loop cycle time in milliseconds")
    p.add_argument("--timeline-filename", metavar="FILE",
                   help="write a Chrome-trace timeline to FILE")
    p.add_argument("--autotune", action="store_true",
                   help="let the runtime tune fusion and cycle time")
    p.add_argument("--max-restarts", type=_non_negative_int, default=0,
                   metavar="K", help="relaunch a failed job up to K times")
    p.add_argument("--min-np", type=_positive_int, metavar="M",
                   help="with --max-restarts: relaunch on the hosts that "
                   "still answer with as few as M ranks (default: -np)")
    p.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="a program that prints the hosts available now "
                   "(hostfile lines); run before every attempt and every "
                   "--discovery-interval seconds while the job runs: the "
                   "job grows and shrinks with it (at the Trainer's next "
                   "checkpoint)")
    p.add_argument("--max-np", type=_positive_int, metavar="N",
                   help="with --host-discovery-script: grow the job up to N "
                   "ranks when hosts join (default: -np)")
    p.add_argument("--discovery-interval", type=_positive_float,
                   metavar="SECONDS",
                   help="with --host-discovery-script: seconds between two "
                   f"runs of it while the job runs (default "
                   f"{resize.DEFAULT_INTERVAL_S:g})")
    p.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                   help="stop the job after SECONDS in all (exit code 124)")
    p.add_argument("--no-prefix", action="store_true",
                   help="do not prefix output lines with [rank]<stream>:")
    p.add_argument("--bind-to", choices=("core", "none"), default="core",
                   help="core (default): each rank of a host runs on its own "
                   "equal share of the host's cores (unbound when ranks "
                   "outnumber CPUs); none: the OS places every rank")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="leave malloc's memory on 4 KiB pages (by default "
                   "each rank starts with glibc.malloc.hugetlb=1 in "
                   "GLIBC_TUNABLES, so large tensors sit on 2 MiB pages)")
    p.add_argument("--verbose", action="store_true",
                   help="print the mpiexec command line and each rank's "
                   "CPU binding")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command to run on every rank")
    return p


def parse_args(argv, environ=None):
    """Parses and validates the launcher's arguments.

    Args:
        argv: the arguments after `kerasdist run`.
        environ: the environment (default os.environ), for the Slurm
            allocation the launcher may run in.

    Returns:
        An argparse.Namespace with `hosts` replaced by [(host, slots), ...]
        (None for this machine only or for hydra to take from Slurm),
        `slurm` the allocation's [(host, slots), ...] or None, and `command`
        without a leading "--".

    Raises:
        UsageError: the input is invalid.
    """
    environ = os.environ if environ is None else environ
    args = make_parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        raise UsageError("no command given (usage: kerasdist run -np N "
                         "command [args...])")
    args.node = None
    args.platform_hostfile = None
    if not any(getattr(args, f) is not None for f in _NODE_FLAGS) and \
            args.np is None and args.hosts is None and \
            args.hostfile is None:
        _node_flags_from_pet(args, environ)
    if any(getattr(args, f) is not None for f in _NODE_FLAGS):
        _check_node_mode(args)
        return args
    if args.hosts is None and args.hostfile is None and \
            args.host_discovery_script is None:
        args.platform_hostfile = platform_hostfile(environ)
    try:
        if args.hosts is not None:
            args.hosts = hosts_lib.parse_host_list(args.hosts)
            source = "-H"
        elif args.hostfile is not None:
            args.hosts = hosts_lib.parse_hostfile(args.hostfile)
            source = f"--hostfile {args.hostfile}"
        elif args.platform_hostfile is not None:
            name, path = args.platform_hostfile
            args.hosts = hosts_lib.parse_hostfile(path, f"{name}={path}")
            source = f"{name}={path}"
        args.ssh_argv = (None if args.ssh_command is None else
                         remote.split_command(args.ssh_command))
        args.slurm = slurm.allocation(environ)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.slurm is not None:
        _check_against_slurm(args, environ)
    elif args.np is None and args.platform_hostfile is not None:
        args.np = hosts_lib.total_slots(args.hosts)
    elif args.np is None:
        raise UsageError("-np N is required outside a Slurm allocation "
                         "(usage: kerasdist run -np N command [args...])")
    if args.hosts is not None:
        slots = hosts_lib.total_slots(args.hosts)
        if args.np is None:
            args.np = slots
        if args.np > slots:
            raise UsageError(
                f"-np {args.np} is more than the {slots} slot(s) given by "
                f"{source} ({hosts_lib.hydra_hosts_arg(args.hosts)})")
    _check_elastic(args)
    return args


_NODE_FLAGS = ("nnodes", "node_rank", "nproc_per_node", "master_addr",
               "master_port")

# The hostfile an MPI platform names for its launcher, in the order looked
# at: MPICH's hydra (Kubeflow's MPIJob with mpiImplementation MPICH), Intel
# MPI's hydra (Intel), Open MPI (OpenMPI, and Kubeflow Trainer's MPI
# runtime). The MPIJob operator mounts the file at /etc/mpi/hostfile.
PLATFORM_HOSTFILES = ("HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE",
                      "OMPI_MCA_orte_default_hostfile",
                      "OMPI_MCA_prte_default_hostfile")

# torchrun reads its flags' defaults from PET_<FLAG> (Kubeflow Trainer's
# torch runtime and PyTorchJob set these in each pod); so does node mode.
_PET_FLAGS = (("nnodes", "PET_NNODES"), ("node_rank", "PET_NODE_RANK"),
              ("nproc_per_node", "PET_NPROC_PER_NODE"),
              ("master_addr", "PET_MASTER_ADDR"),
              ("master_port", "PET_MASTER_PORT"))


def platform_hostfile(environ):
    """(variable, path) of the first hostfile a platform names in
    `environ` (PLATFORM_HOSTFILES), or None."""
    for name in PLATFORM_HOSTFILES:
        path = environ.get(name, "").strip()
        if path:
            return name, path
    return None


def _node_flags_from_pet(args, environ):
    """Node mode from torchrun's PET_* variables where the command line
    names neither ranks nor hosts (no -np, -H, --hostfile, node flags):
    PET_NNODES and PET_NODE_RANK are required for it, the others are
    optional as with the flags."""
    if not (environ.get("PET_NNODES", "").strip() and
            environ.get("PET_NODE_RANK", "").strip()):
        return
    given = []
    for flag, name in _PET_FLAGS:
        value = environ.get(name, "").strip()
        if value:
            setattr(args, flag, value)
            given.append(f"{name}={value}")
    args.node_from_pet = " ".join(given)


def _check_node_mode(args):
    """Node mode: the node's Plan in args.node, -np its world size."""
    for given, flag in ((args.hosts is not None, "-H"),
                        (args.hostfile is not None, "--hostfile"),
                        (args.max_restarts > 0, "--max-restarts"),
                        (args.min_np is not None, "--min-np"),
                        (args.host_discovery_script is not None,
                         "--host-discovery-script"),
                        (args.max_np is not None, "--max-np"),
                        (args.discovery_interval is not None,
                         "--discovery-interval")):
        if given:
            raise UsageError(
                f"{flag} does not go with node mode (--nnodes, --node-rank, "
                f"--nproc-per-node, --master-addr, --master-port): there "
                f"each host starts its own ranks; leave out {flag}, or the "
                f"node-mode flags to start the job from one host.")
    try:
        args.node = node.plan(args.nnodes, args.node_rank,
                              args.nproc_per_node, args.master_addr,
                              args.master_port, args.np)
    except ValueError as e:
        if getattr(args, "node_from_pet", False):
            raise UsageError(f"node mode from the PET_* variables "
                             f"({args.node_from_pet}):"
                             f" {e} (the flag is the variable's; in a "
                             f"TrainJob set numNodes and numProcPerNode "
                             f"to numbers)") from None
        raise UsageError(str(e)) from None
    args.np = args.node.world_size
    args.min_np = args.max_np = args.np
    args.ssh_argv = None
    args.slurm = None


def _check_elastic(args):
    if args.host_discovery_script is not None:
        if args.hosts is not None:
            raise UsageError("--host-discovery-script lists the hosts: leave "
                             "out -H/--hostfile")
        if not os.access(args.host_discovery_script, os.X_OK):
            raise UsageError(f"--host-discovery-script "
                             f"{args.host_discovery_script}: not an "
                             "executable file")
    else:
        for value, flag in ((args.max_np, "--max-np"),
                            (args.discovery_interval,
                             "--discovery-interval")):
            if value is not None:
                raise UsageError(
                    f"{flag} needs --host-discovery-script: the job grows "
                    f"and shrinks with the hosts that script lists; give "
                    f"one, or leave out {flag}")
    if args.min_np is not None and args.min_np > args.np:
        raise UsageError(f"--min-np {args.min_np} is more than -np {args.np}")
    if args.max_np is not None and args.max_np < args.np:
        raise UsageError(f"--max-np {args.max_np} is less than -np {args.np} "
                         "(the job starts with -np ranks and grows up to "
                         "--max-np)")
    if args.min_np is None:
        args.min_np = args.np
    if args.max_np is None:
        args.max_np = args.np
    if args.discovery_interval is None:
        args.discovery_interval = resize.DEFAULT_INTERVAL_S


def _check_against_slurm(args, environ):
    """Inside an allocation: -H/--hostfile, when given, win but must name
    hosts of the allocation; otherwise -np defaults to its tasks and may not
    exceed them (hydra then takes the hosts from Slurm itself)."""
    nodes = environ.get(slurm.NODELIST)
    if args.hosts is not None:
        outside = [h for h, _ in args.hosts
                   if h not in {n for n, _ in args.slurm}]
        if outside:
            raise UsageError(
                f"host {outside[0]} is not in this Slurm allocation "
                f"({slurm.NODELIST}={nodes}); name hosts of the allocation "
                "or leave out -H/--hostfile to use all of it")
        return
    tasks = hosts_lib.total_slots(args.slurm)
    if args.np is None:
        args.np = tasks
    elif args.np > tasks:
        raise UsageError(
            f"-np {args.np} is more than the {tasks} task(s) of this Slurm "
            f"allocation ({slurm.TASKS_PER_NODE}="
            f"{environ.get(slurm.TASKS_PER_NODE, '1 per node')}); ask Slurm "
            f"for more (salloc -n {args.np}) or lower -np")


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


QUIET_TF_ENV = "TF_CPP_MIN_LOG_LEVEL"


def _rank_env(args, attempt):
    env = settings.build_env(
        attempt,
        fusion_threshold_mb=args.fusion_threshold_mb,
        cycle_time_ms=args.cycle_time_ms,
        timeline_filename=args.timeline_filename,
        autotune=args.autotune,
        network_interface=args.network_interface,
    )
    if getattr(args, "host_discovery_script", None) is not None and \
            args.node is None:
        env[_rank.ELASTIC_ENV] = "1"  # see kerasdist/run/resize.py
    # TensorFlow's C++ start-up lines (CPU features, oneDNN, absl's notice)
    # would come once per rank before the first epoch: warnings and errors
    # only, unless the caller chose a level.
    if QUIET_TF_ENV not in os.environ:
        env[QUIET_TF_ENV] = "1"
    return env


def main(argv=None):
    """Entry point of `kerasdist run`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    log = job.Log()
    try:
        args = parse_args(argv)
    except UsageError as e:
        log.raw(f"{PROG}: error: {e}\n".encode())
        return 2
    problem = _rank.command_problem(args.command[0])
    if problem is not None:
        log.raw(f"{PROG}: error: {problem}.\n".encode())
        return 2
    if args.node is not None:
        if getattr(args, "node_from_pet", False):
            log.line(f"node mode from the PET_* variables: node "
                     f"{args.node.node_rank} of {args.node.nnodes}, "
                     f"{args.node.nproc_per_node} rank(s) here, master "
                     f"{args.node.master_addr}:{args.node.master_port}")
        return _run_node(args, log)
    if args.platform_hostfile is not None:
        name, path = args.platform_hostfile
        log.line(f"hosts from {name}={path}: "
                 f"{hosts_lib.hydra_hosts_arg(args.hosts)}")
    try:
        mpiexec = find_mpiexec()
        _rank_env(args, 0)  # the core library names the variables
    except (FileNotFoundError, ImportError) as e:
        log.raw(f"{PROG}: error: {e}\n".encode())
        return 1

    if not _check_remote_hosts(args, log):
        return 1
    with _elastic_dir(args), _job_secret():
        # Intel MPI's mpiexec gets its hosts in a file (intel_mpi.py).
        if (args.ssh_argv is None or len(args.ssh_argv) == 1) and \
                not intel_mpi.is_intel_mpiexec(mpiexec):
            return _run(args, mpiexec, log)
        with tempfile.TemporaryDirectory(prefix="kerasdist-run-") as workdir:
            return _run(args, mpiexec, log, workdir)


class _job_secret:
    """Every job gets a random secret of its own in KERASDIST_JOB_SECRET
    (unless one is set already), which its ranks prove on every control
    connection (the heartbeat, kerasdist/run/rendezvous.py; SECURITY.md).
    It travels in the environment (hydra's -genvall, Open MPI's -x), never
    on a command line."""

    def __enter__(self):
        self.made = not os.environ.get(rendezvous.SECRET_ENV)
        if self.made:
            os.environ[rendezvous.SECRET_ENV] = secrets.token_hex(32)
        # And the token of the per-rank wrappers' exit markers (_rank.py).
        os.environ[_rank.MARKER_TOKEN_ENV] = secrets.token_hex(16)
        return self

    def __exit__(self, *exc):
        if self.made:
            os.environ.pop(rendezvous.SECRET_ENV, None)
        os.environ.pop(_rank.MARKER_TOKEN_ENV, None)
        return False


class _elastic_dir:
    """A job that may be relaunched (--max-restarts, or one that grows and
    shrinks) gets a directory of its own for `hvd.elastic`'s commits
    (kerasdist/elastic.py), in KERASDIST_ELASTIC_DIR for every rank and
    attempt, removed when the job ends; unless KERASDIST_ELASTIC_DIR is
    set already (a directory every host sees, for jobs whose rank 0 may
    move to another host), which is kept."""

    def __init__(self, args):
        self.wanted = (args.max_restarts > 0 or getattr(
            args, "host_discovery_script", None) is not None) and \
            not os.environ.get(_rank.ELASTIC_DIR_ENV)
        self.path = None

    def __enter__(self):
        if self.wanted:
            self.path = tempfile.mkdtemp(prefix="kerasdist-elastic-")
            os.environ[_rank.ELASTIC_DIR_ENV] = self.path
        return self

    def __exit__(self, *exc):
        if self.path is not None:
            os.environ.pop(_rank.ELASTIC_DIR_ENV, None)
            shutil.rmtree(self.path, ignore_errors=True)
        return False


def _run_node(args, log):
    """Node mode: this host's ranks under node.py's process manager."""
    wrong = site_mpi.check_rendezvous("kerasdist run --nnodes (node mode)")
    if wrong:
        log.raw(f"{PROG}: error: {wrong}\n".encode())
        return 2
    try:
        rank_env = _rank_env(args, 0)
    except ImportError as e:
        log.raw(f"{PROG}: error: {e}\n".encode())
        return 1
    wrapper = rank_wrapper_argv(args.no_prefix, bind=args.bind_to == "core",
                                report_bind=args.verbose,
                                huge_pages=not args.no_huge_pages)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    with job.Interrupts() as interrupts:
        outcome = node.run(args.node, args.command, rank_env, wrapper,
                           interrupts, deadline, args.timeout, log,
                           verbose=args.verbose)
    return outcome.exit_code


def _check_remote_hosts(args, log):
    """Names each remote host its remote shell cannot reach; True if none."""
    if args.slurm is not None and args.ssh_argv is None:
        return True  # hydra starts the ranks with srun, not a remote shell
    shell = remote.effective_command(args.ssh_argv, os.environ)
    remote_hosts = [h for h, _ in args.hosts or () if not remote.is_local(h)]
    if not remote_hosts or shell is None:
        return True
    failed = remote.check_hosts(remote_hosts, shell)
    for host, reason in failed:
        log.raw(f"{PROG}: error: cannot start ranks on host {host}: "
                f"`{shlex.join(shell)} {host} true` failed: {reason}. Check "
                f"the host name and that this command works without a "
                f"password, or give another remote shell with "
                f"--ssh-command.\n".encode())
    return not failed


class Attempts:
    """Counts a job's attempts: a failed one uses up one of --max-restarts,
    a resize (the ranks stopped at a checkpoint because hosts joined or
    left) does not.

    Attributes:
        started: attempts started so far (the next one's
            KERASDIST_RESTART_ATTEMPT).
        restarts: relaunches after a failure so far.
        resizes: relaunches after a resize so far.
    """

    def __init__(self, max_restarts):
        self.max_restarts = max_restarts
        self.started = self.restarts = self.resizes = 0
        self.repeated = None  # the error two attempts in a row ended with
        self._last_error = None

    def start(self):
        """Notes an attempt's start; returns its number from 0."""
        self.started += 1
        return self.started - 1

    def after(self, outcome):
        """"resize" or "restart" to go on after `outcome`, None to stop."""
        if outcome.resized:
            self.resizes += 1
            return "resize"
        # An attempt that saved progress (a checkpoint) is compared with
        # neither neighbour: it did not repeat the one before, and the next
        # one starts from a later point.
        last, self._last_error = self._last_error, (
            None if outcome.progressed else outcome.error)
        if not outcome.retryable or self.restarts >= self.max_restarts:
            return None
        if self._last_error is not None and self._last_error == last:
            # The same ranks failed with the same words again, with no
            # progress saved in between: a relaunch would only repeat it.
            self.repeated = outcome.error
            return None
        self.restarts += 1
        return "restart"

    @property
    def most(self):
        """The most attempts the job may have, as far as known now."""
        return self.max_restarts + self.resizes + 1


def _run(args, mpiexec, log, workdir=None):
    launcher_exec = (None if args.ssh_argv is None else
                     remote.launcher_exec(args.ssh_argv, workdir))
    intel = intel_mpi.is_intel_mpiexec(mpiexec)
    attempts = Attempts(args.max_restarts)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    outcome = then = announced = None
    quick = 0  # attempts in a row that failed within _QUICK_S
    with job.Interrupts() as interrupts:
        while True:
            placed = _place(args, log, attempts.started > 0)
            if placed is None:
                return 1 if outcome is None or outcome.resized else \
                    outcome.exit_code
            np_, hosts = placed
            attempt = attempts.start()
            if then == "restart":
                where = ("" if np_ == args.np and hosts == args.hosts else
                         f" on {np_} rank(s)"
                         + (f" ({hosts_lib.hydra_hosts_arg(hosts)})"
                            if hosts else ""))
                log.line(f"attempt {attempt + 1} of {attempts.most}{where} "
                         f"(the last attempt ended because {outcome.reason})")
            elif then == "resize" and np_ != announced:
                log.line(f"starting {np_} rank(s) instead "
                         f"({hosts_lib.hydra_hosts_arg(hosts)}): the hosts "
                         f"changed again")
            rank_env = _rank_env(args, attempt)
            machinefile = None
            if intel:
                rank_env.update(intel_mpi.rank_env(os.environ))
                if hosts:
                    machinefile = intel_mpi.write_machinefile(hosts, workdir)
            mpi_argv = build_mpiexec_argv(mpiexec, np_, args.command,
                                          rank_env, hosts, args.no_prefix,
                                          bind=args.bind_to == "core",
                                          report_bind=args.verbose,
                                          huge_pages=not args.no_huge_pages,
                                          launcher_exec=launcher_exec,
                                          iface=args.network_interface,
                                          machinefile=machinefile)
            if args.verbose:
                log.line(f"running: {shlex.join(mpi_argv)}")
            env = dict(os.environ, **rank_env)
            watcher = _watcher(args, log, np_, hosts)
            began = time.monotonic()
            began_at = time.time()
            outcome = job.run_attempt(mpi_argv, env, interrupts, deadline,
                                      args.timeout, log, banner=args.verbose,
                                      watcher=watcher, ranks=np_)
            if outcome.exit_code != 0:
                # What MPICH's dead ranks left in /dev/shm on this host.
                shm.remove_orphans(began_at - 1.0)
            if outcome.resized:
                announced = watcher.requested.new_np
            then = attempts.after(outcome)
            if then is None:
                break
            if then == "restart":
                # An attempt that saved progress (a checkpoint) is no
                # start-up failure, however short it was.
                quick = (quick + 1 if time.monotonic() - began < _QUICK_S
                         and not outcome.progressed else 0)
                stopped = _back_off(quick, deadline, args.timeout,
                                    interrupts, log)
                if stopped is not None:
                    return stopped
        if attempts.repeated is not None:
            rank, _, said = attempts.repeated[0]
            log.line(f"not restarting: attempt {attempts.started} failed "
                     f"as attempt {attempts.started - 1} did (rank {rank}: "
                     f"{said}), an error a restart repeats.")
        elif outcome.retryable and attempts.max_restarts > 0:
            log.line(f"giving up after {attempts.started} attempts.")
    return outcome.exit_code


# Restarts back off: an attempt that failed within _QUICK_S seconds is
# followed by a pause, doubling from _BACKOFF_S up to _BACKOFF_MOST_S while
# they keep failing that fast (a job that cannot start must not restart
# ten times a second). An attempt that saved progress resets the count.
_QUICK_S = 60.0
_BACKOFF_S = 0.5
_BACKOFF_MOST_S = 30.0


def _back_off(quick, deadline, timeout, interrupts, log):
    """Waits before a restart; returns the exit code when --timeout or a
    signal ends the job instead, else None."""
    pause = 0.0 if quick == 0 else min(_BACKOFF_S * 2 ** (quick - 1),
                                       _BACKOFF_MOST_S)
    if pause:
        log.line(f"the attempt failed within {_QUICK_S:g} s of its start; "
                 f"waiting {pause:g} s before the next.")
    end = time.monotonic() + pause
    while True:
        if interrupts.signum is not None:
            log.line(f"received {signal.Signals(interrupts.signum).name}; "
                     f"not restarting.")
            return 128 + interrupts.signum
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            log.line(f"the job timed out after {timeout:g} s; not "
                     f"restarting.")
            return 124
        if now >= end:
            return None
        time.sleep(min(0.05, end - now))


def _watcher(args, log, np_, hosts):
    """The attempt's resize.Watcher, or None outside an elastic job."""
    if args.host_discovery_script is None or hosts is None:
        return None
    shell = remote.effective_command(args.ssh_argv, os.environ)

    def answering(candidates):
        return elastic.answering(candidates, shell, args.network_interface)

    return resize.Watcher(
        lambda: elastic.discover(args.host_discovery_script), answering,
        np_, hosts, args.min_np, args.max_np, args.discovery_interval, log)


def _candidate_hosts(args, log):
    if args.host_discovery_script is None:
        return args.hosts
    try:
        return elastic.discover(args.host_discovery_script)
    except ValueError as e:
        log.line(f"{e}; taking no hosts from it this time.")
        return []


def _place(args, log, restarting):
    """(np, hosts) for the next attempt, or None when too few hosts answer.

    The first attempt runs where it was asked (hosts from the discovery
    script, if any); a restart, or a run with --host-discovery-script, only
    on the hosts that answer now (elastic.answering), with up to -np ranks
    (the first attempt) or --max-np (the later ones).
    """
    hosts = _candidate_hosts(args, log)
    if hosts is None:
        return args.np, None  # this machine, or the Slurm allocation
    if restarting or args.host_discovery_script is not None:
        shell = remote.effective_command(args.ssh_argv, os.environ)
        hosts, failed = elastic.answering(hosts, shell, args.network_interface)
        for host, reason in failed:
            log.line(f"host {host} does not answer ({reason}); leaving it "
                     "out.")
    # The first attempt starts -np ranks; later ones as many as fit, up to
    # --max-np (which is -np unless the job may grow).
    target = args.max_np if restarting else args.np
    np_ = elastic.ranks_for(target, args.min_np, hosts)
    if np_ is None:
        slots = hosts_lib.total_slots(hosts) if hosts else 0
        log.line(f"giving up: the hosts that answer have {slots} slot(s) "
                 f"({hosts_lib.hydra_hosts_arg(hosts) or 'none'}), fewer "
                 f"than --min-np {args.min_np}.")
        return None
    return np_, hosts
