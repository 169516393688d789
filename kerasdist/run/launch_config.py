"""`kerasdist run`'s command line, read into a frozen `LaunchConfig`.

    parse_args(argv, environ) -> LaunchConfig

`make_parser` reads the flags, `config_from_args` checks them against each
other and against the environment the launcher runs in (a Slurm
allocation, a platform's hostfile, torchrun's PET_* variables for node
mode) and fills in the defaults; what comes out is all that the rest of
the launcher (launch.py, mpi_command.py, attempt_loop.py, node.py) reads.
Bad input raises UsageError, which `kerasdist run` reports in one line
with exit code 2.

Over 500 lines: every flag with its parser, its bound (docs/launcher.md,
"Bounds") and its checks against the others, so that what the launcher
accepts reads in one place, in the order of its help.

Standard library only (see launch.py).
"""

import argparse
import dataclasses
import os
from typing import Optional

from kerasdist._core import site_mpi
from kerasdist.rendezvous import tcp_job
from kerasdist.run import hosts as hosts_lib
from kerasdist.run import node
from kerasdist.run import remote
from kerasdist.run import resize
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


def _int_at_most(parse, most, what):
    """`parse`'s integer, at most `most`: a typo is refused before anything
    is sized by it (docs/launcher.md, "Bounds")."""
    def check(text):
        value = parse(text)
        if value > most:
            raise argparse.ArgumentTypeError(
                f"{text} is above {most}, the most {what}")
        return value
    return check


_ranks = _int_at_most(_positive_int, hosts_lib.MAX_RANKS, "ranks of a "
                      "kerasdist job; give the number of ranks to run")


def _num_proc(text):
    # argparse reads "-np2" as "-n p2" (-n is -np's short form): take it
    # as the "-np 2" it means.
    if len(text) > 1 and text[0] == "p" and text[1:].isdigit():
        text = text[1:]
    return _ranks(text)


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
    value = _at_most(1e9, "seconds it may be (31 years)")(text)
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
    mode.add_argument("--join", action="store_true", default=None,
                      help="join the running job whose rank 0 serves at "
                      "--master-addr:--master-port, over the TCP transport "
                      "(KERASDIST_TRANSPORT=tcp) with recovery in place: "
                      "this host's --nproc-per-node processes come in at "
                      "its next commit (growing in place; see "
                      "docs/failures-and-elastic.md)")
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
    p.add_argument("--max-restarts", default=0, type=_int_at_most(
                       _non_negative_int, 1_000_000, "restarts of a job; give "
                       "how many times to relaunch a failed job"),
                   metavar="K", help="relaunch a failed job up to K times")
    p.add_argument("--min-np", type=_ranks, metavar="M",
                   help="with --max-restarts: relaunch on the hosts that "
                   "still answer with as few as M ranks (default: -np)")
    p.add_argument("--recover-in-place", action="store_true",
                   help="a lost rank ends no other: the survivors keep "
                   "their processes, re-form without it and go on at the "
                   "smaller size (kerasdist.elastic.run); the job exits 0 "
                   "when they finish. Needs kerasdist built against Open "
                   "MPI 5 (ULFM), or the TCP transport "
                   "(KERASDIST_TRANSPORT=tcp); see "
                   "docs/failures-and-elastic.md")
    p.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="a program that prints the hosts available now "
                   "(hostfile lines); run before every attempt and every "
                   "--discovery-interval seconds while the job runs: the "
                   "job grows and shrinks with it (at the Trainer's next "
                   "checkpoint)")
    p.add_argument("--max-np", type=_ranks, metavar="N",
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


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything `kerasdist run` acts on, checked and with its defaults.

    Host lists are tuples of (host, slots); every field is as the flag of
    the same name gives it unless said otherwise.

    Attributes:
        command: the command every rank runs (without a leading "--").
        np: ranks of the first attempt (node mode: the job's world size).
        hosts: ((host, slots), ...) to run on, or None for this machine
            only or for hydra to take the hosts from Slurm.
        platform_hostfile: (variable, path) of the platform's hostfile the
            hosts came from (hosts.PLATFORM_HOSTFILES), or None.
        slurm: the Slurm allocation's ((host, slots), ...), or None outside
            one.
        ssh_argv: the remote shell of --ssh-command (or $KERASDIST_SSH),
            split into words, or None for hydra's default.
        node: node mode's node.Plan, or None when mpiexec starts the ranks.
        node_from_pet: the PET_* variables ("PET_NNODES=2 ...") node mode
            was read from, or "" (the flags, or no node mode).
        min_np, max_np: the fewest ranks a restart may run on and the most
            the job may grow to (both -np unless given).
        discovery_interval: seconds between two runs of the discovery
            script (None in node mode).
    """

    command: tuple
    np: int
    hosts: Optional[tuple] = None
    platform_hostfile: Optional[tuple] = None
    slurm: Optional[tuple] = None
    ssh_argv: Optional[tuple] = None
    network_interface: Optional[str] = None
    node: Optional[tuple] = None  # a node.Plan
    node_from_pet: str = ""
    fusion_threshold_mb: Optional[float] = None
    cycle_time_ms: Optional[float] = None
    timeline_filename: Optional[str] = None
    autotune: bool = False
    max_restarts: int = 0
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    host_discovery_script: Optional[str] = None
    discovery_interval: Optional[float] = None
    timeout: Optional[float] = None
    no_prefix: bool = False
    bind_to: str = "core"
    no_huge_pages: bool = False
    verbose: bool = False
    recover_in_place: bool = False
    join: bool = False


def parse_args(argv, environ=None):
    """Parses and validates the launcher's arguments.

    Args:
        argv: the arguments after `kerasdist run`.
        environ: the environment (default os.environ), for the Slurm
            allocation, platform hostfile or PET_* variables the launcher
            may run with.

    Returns:
        The LaunchConfig.

    Raises:
        UsageError: the input is invalid.
    """
    environ = os.environ if environ is None else environ
    return config_from_args(make_parser().parse_args(argv), environ)


def config_from_args(args, environ):
    """The LaunchConfig of `args`, the argparse.Namespace of make_parser
    (which this fills in as it checks it).

    Raises:
        UsageError: the input is invalid.
    """
    command = _command(args.command)
    args.node = args.platform_hostfile = args.ssh_argv = args.slurm = None
    args.node_from_pet = ""
    if not _node_flags_given(args) and args.np is None and \
            args.hosts is None and args.hostfile is None:
        _node_flags_from_pet(args, environ)
    if _node_flags_given(args):
        _check_node_mode(args, environ)
        return _freeze(args, command)
    source = _read_hosts(args, environ)
    tcp = _transport_is_tcp(environ)
    if tcp and args.slurm is not None and args.hosts is None:
        raise UsageError(
            f"{tcp_job.TRANSPORT_ENV}=tcp inside a Slurm allocation: over "
            f"TCP the launcher starts remote ranks with a remote shell, "
            f"not srun; give the hosts with -H, or run `srun kerasdist run "
            f"--nnodes N --node-rank $SLURM_NODEID ...` (node mode), or "
            f"leave the transport to MPI.")
    if args.slurm is not None:
        _check_against_slurm(args, environ)
    elif args.np is None and args.platform_hostfile is not None:
        args.np = hosts_lib.total_slots(args.hosts)
    elif args.np is None:
        raise UsageError("-np N is required outside a Slurm allocation "
                         "(usage: kerasdist run -np N command [args...])")
    if args.hosts is not None:
        _check_slots(args, source)
    try:  # -np also where the slots give it; no hosts: this one only
        hosts_lib.check_ranks(args.np, source, args.hosts is None and
                              args.slurm is None and
                              args.host_discovery_script is None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_elastic(args, tcp)
    return _freeze(args, command)


def _transport_is_tcp(environ):
    try:
        return tcp_job.wanted(environ)
    except ValueError as e:
        raise UsageError(f"{e}, in the launcher's environment") from None


def _command(command):
    """The command without a leading "--"; a UsageError when empty."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given (usage: kerasdist run -np N "
                         "command [args...])")
    return tuple(command)


def _freeze(args, command):
    """The LaunchConfig of the checked `args`, its lists made tuples."""
    def frozen(value):
        return None if value is None else tuple(value)
    return LaunchConfig(
        command=command, np=args.np, hosts=frozen(args.hosts),
        platform_hostfile=args.platform_hostfile, slurm=frozen(args.slurm),
        ssh_argv=frozen(args.ssh_argv),
        network_interface=args.network_interface, node=args.node,
        node_from_pet=args.node_from_pet,
        fusion_threshold_mb=args.fusion_threshold_mb,
        cycle_time_ms=args.cycle_time_ms,
        timeline_filename=args.timeline_filename, autotune=args.autotune,
        max_restarts=args.max_restarts, min_np=args.min_np,
        max_np=args.max_np, host_discovery_script=args.host_discovery_script,
        discovery_interval=args.discovery_interval, timeout=args.timeout,
        no_prefix=args.no_prefix, bind_to=args.bind_to,
        no_huge_pages=args.no_huge_pages, verbose=args.verbose,
        recover_in_place=args.recover_in_place, join=bool(args.join))


_NODE_FLAGS = ("nnodes", "node_rank", "nproc_per_node", "master_addr",
               "master_port", "join")


def _node_flags_given(args):
    return any(getattr(args, f) is not None for f in _NODE_FLAGS)


def _read_hosts(args, environ):
    """Replaces args.hosts by the hosts of -H, --hostfile or the platform's
    hostfile, and reads the remote shell and the Slurm allocation; returns
    where the hosts came from, for messages."""
    if args.hosts is None and args.hostfile is None and \
            args.host_discovery_script is None:
        args.platform_hostfile = hosts_lib.platform_hostfile(environ)
    source = None
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
    return source


def _check_slots(args, source):
    """-np defaults to the hosts' slots and may not exceed them."""
    slots = hosts_lib.total_slots(args.hosts)
    if args.np is None:
        args.np = slots
    if args.np > slots:
        raise UsageError(
            f"-np {args.np} is more than the {slots} slot(s) given by "
            f"{source} ({hosts_lib.hydra_hosts_arg(args.hosts)})")


# torchrun reads its flags' defaults from PET_<FLAG> (Kubeflow Trainer's
# torch runtime and PyTorchJob set these in each pod); so does node mode.
_PET_FLAGS = (("nnodes", "PET_NNODES"), ("node_rank", "PET_NODE_RANK"),
              ("nproc_per_node", "PET_NPROC_PER_NODE"),
              ("master_addr", "PET_MASTER_ADDR"),
              ("master_port", "PET_MASTER_PORT"))


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


def _check_node_mode(args, environ):
    """Node mode: the node's Plan in args.node, -np its world size.
    --recover-in-place goes with it over the TCP transport only."""
    try:
        tcp = tcp_job.wanted(environ)
    except ValueError as e:
        raise UsageError(f"{e}, in the launcher's environment") from None
    if args.join:
        _check_join(args, tcp)
    if args.recover_in_place and not tcp:
        raise UsageError(
            f"--recover-in-place in node mode needs the TCP transport "
            f"({tcp_job.TRANSPORT_ENV}=tcp in the launcher's environment): the "
            f"ranks of each host then re-form among themselves through the "
            f"rendezvous, with no MPI; or leave out the node-mode flags to "
            f"start the job from one host under Open MPI's ULFM.")
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
        if args.node_from_pet:
            raise UsageError(f"node mode from the PET_* variables "
                             f"({args.node_from_pet}):"
                             f" {e} (the flag is the variable's; in a "
                             f"TrainJob set numNodes and numProcPerNode "
                             f"to numbers)") from None
        raise UsageError(str(e)) from None
    args.np = args.node.world_size
    args.min_np = args.max_np = args.np


def _check_join(args, tcp):
    """--join: this host's processes join a running TCP job, which numbers
    them (no --nnodes, no --node-rank); it implies --recover-in-place."""
    if not tcp:
        raise UsageError(
            f"--join needs the TCP transport ({tcp_job.TRANSPORT_ENV}=tcp "
            f"in the launcher's environment), which the running job's "
            f"ranks use too: only a TCP job with recovery in place lets "
            f"processes in while it runs.")
    for value, flag in ((args.nnodes, "--nnodes"),
                        (args.node_rank, "--node-rank")):
        if value is not None:
            raise UsageError(
                f"{flag} does not go with --join: the running job numbers "
                f"the processes that join it; give --nproc-per-node, "
                f"--master-addr and --master-port.")
    if args.master_addr is None or args.master_port is None:
        raise UsageError(
            "--join needs --master-addr and --master-port: where the "
            "running job's rank 0 serves its rendezvous.")
    args.recover_in_place = True


def _check_elastic(args, tcp=False):
    """--min-np, --max-np and the discovery script's flags; fills in their
    defaults. `tcp`: the job runs over the TCP transport."""
    _check_discovery(args)
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
    if not tcp:  # over TCP the ranks re-form with no MPI (tcp_launch.py)
        _check_recovery(args)


def _check_recovery(args, rec=None):
    """--recover-in-place needs a build against an MPI with ULFM (Open MPI
    5's mpirun --with-ft ulfm). With a discovery script the job grows and
    shrinks in place (kerasdist/run/grow.py) where its ranks run
    hvd.elastic.run."""
    if not args.recover_in_place:
        return
    rec = site_mpi.record() if rec is None else rec
    if site_mpi.vendor(rec).family != "openmpi":
        raise UsageError(
            f"--recover-in-place needs kerasdist built against Open MPI 5 "
            f"(its ULFM fault tolerance keeps the survivors' processes), "
            f"but it was built against {site_mpi.describe(rec)}; build it "
            f"against Open MPI (docs/mpi.md, \"Your cluster's MPI\"), or "
            f"use --max-restarts, which relaunches from the last commit on "
            f"disk (docs/failures-and-elastic.md).")


def _check_discovery(args):
    """--host-discovery-script names an executable and replaces the hosts;
    --max-np and --discovery-interval need it."""
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
