"""Host lists for `kerasdist run`: `-H host1:2,host2:2` and hostfiles,
also the hostfile a platform names for its MPI launcher.

Pure functions; a malformed entry raises ValueError with a message that says
what was expected and what was given.
"""

import os
import re

# Bounds (docs/launcher.md, "Bounds"): far above any real job, low enough
# that a typo (-np 100000000000000000000, slots=1000000000) is refused in
# one line before anything is sized by it. The most ranks of a job (as
# conventions.MAX_PROCESSES, the most a rank's kd.init() forms a job of):
MAX_RANKS = 1 << 20
# The most ranks of one host: each is a process of its own with tens of MB
# at least, and no machine has more than a few thousand hardware threads;
# 4 a CPU of this machine where that is more.
MAX_RANKS_PER_HOST = max(4096, 4 * (os.cpu_count() or 1))
# The most bytes of a hostfile, or of a discovery script's output.
MAX_HOSTFILE_BYTES = 16 << 20

# A host name or address as mpiexec's -hosts accepts it (no ':' or ',').
_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")


def _slots(text, where):
    # Digits only, and at most a dozen of them before int() reads them.
    if not text.isdigit() or int(text[:13]) < 1:
        raise ValueError(
            f"{where}: slots must be a positive integer, got {text!r}"
        )
    return check_per_host(int(text) if len(text) < 13 else
                          MAX_RANKS_PER_HOST + 1, where, text)


def check_per_host(slots, where, text=None):
    """`slots` if at most MAX_RANKS_PER_HOST, else ValueError naming
    `where` (and `text`, the slots as given)."""
    if slots > MAX_RANKS_PER_HOST:
        raise ValueError(
            f"{where}: {text or slots} slots is above {MAX_RANKS_PER_HOST}, "
            f"the most ranks kerasdist runs on one host; give the ranks "
            f"the host runs"
        )
    return slots


def _host(text, where):
    if not _HOST_RE.match(text):
        raise ValueError(f"{where}: invalid host name {text!r}")
    return text


def parse_host_entry(entry, where="-H"):
    """Parses `host` or `host:slots` into (host, slots); slots defaults to 1.

    Args:
        entry: one entry, e.g. "node1:4".
        where: what to name in an error message.

    Returns:
        A (host, slots) tuple.

    Raises:
        ValueError: the entry is malformed.
    """
    entry = entry.strip()
    if not entry:
        raise ValueError(f"{where}: empty host entry")
    host, sep, slots = entry.partition(":")
    if sep and ":" in slots:
        raise ValueError(f"{where}: expected host or host:slots, got {entry!r}")
    return _host(host, where), (_slots(slots, where) if sep else 1)


def parse_host_list(text):
    """Parses `-H host1:2,host2:2` into [(host, slots), ...].

    Raises:
        ValueError: an entry is malformed or the list is empty.
    """
    if not text or not text.strip():
        raise ValueError("-H: expected host1:slots,host2:slots, got ''")
    return merge_hosts(
        [parse_host_entry(e, f"-H {text!r}") for e in text.split(",")]
    )


def parse_hostfile_text(text, name="hostfile"):
    """Parses hostfile contents into [(host, slots), ...].

    Each line is `host`, `host:slots` or `host slots=N` (also `slots:N` and
    Open MPI's `max_slots=`, which is ignored). `#` starts a comment; blank
    lines are skipped.

    Raises:
        ValueError: a line is malformed (the message names the line), or
            the file lists no hosts.
    """
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        words = line.split()
        if len(words) == 1:
            hosts.append(parse_host_entry(words[0], where))
            continue
        host = _host(words[0], where)
        slots = None
        for word in words[1:]:
            key, sep, value = word.replace(":", "=", 1).partition("=")
            if not sep or key not in ("slots", "max_slots"):
                raise ValueError(
                    f"{where}: expected 'host slots=N' or 'host:N', "
                    f"got {line!r}"
                )
            if key == "slots":
                slots = _slots(value, where)
        hosts.append((host, 1 if slots is None else slots))
    if not hosts:
        raise ValueError(f"{name}: no hosts listed")
    return merge_hosts(hosts)


def parse_hostfile(path, what="--hostfile"):
    """Reads and parses a hostfile; see parse_hostfile_text.

    Args:
        path: the file.
        what: where its name came from, for an error message (the flag, or
            the platform's variable).

    Raises:
        ValueError: the file cannot be read or is malformed.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HOSTFILE_BYTES + 1)
    except OSError as e:
        raise ValueError(
            f"{what}: cannot read {path!r}: {e.strerror or e}"
        ) from None
    if len(data) > MAX_HOSTFILE_BYTES:
        raise ValueError(
            f"{what}: {path!r} is longer than {MAX_HOSTFILE_BYTES >> 20} "
            f"MiB, the most a hostfile may have; give a file of one "
            f"'host slots=N' a line"
        )
    return parse_hostfile_text(data.decode("utf-8", errors="replace"), path)


def merge_hosts(hosts):
    """Adds up the slots of repeated hosts, keeping first-seen order."""
    merged = {}
    for host, slots in hosts:
        merged[host] = check_per_host(merged.get(host, 0) + slots,
                                      f"host {host}")
    return list(merged.items())


def check_ranks(np, source=None, one_host=False):
    """ValueError when -np `np` (the slots of `source`, when it defaulted
    to them) is above MAX_RANKS, or above MAX_RANKS_PER_HOST for a job of
    this host alone (`one_host`)."""
    if np > MAX_RANKS:
        raise ValueError(
            f"-np {np} (the slots of {source or 'the hosts'}) is above "
            f"{MAX_RANKS}, the most ranks of a kerasdist job; give -np N or "
            f"fewer slots")
    if one_host and np > MAX_RANKS_PER_HOST:
        raise ValueError(
            f"-np {np} is above {MAX_RANKS_PER_HOST}, the most ranks "
            f"kerasdist runs on one host, and no hosts are given: give the "
            f"hosts with -H or --hostfile, or fewer ranks")


def total_slots(hosts):
    return sum(slots for _, slots in hosts)


def hydra_hosts_arg(hosts):
    """Formats hosts for hydra's `-hosts`: "host1:2,host2:2"."""
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


# The hostfile an MPI platform names for its launcher, in the order looked
# at: MPICH's hydra (Kubeflow's MPIJob with mpiImplementation MPICH), Intel
# MPI's hydra (Intel), Open MPI (OpenMPI, and Kubeflow Trainer's MPI
# runtime). The MPIJob operator mounts the file at /etc/mpi/hostfile.
PLATFORM_HOSTFILES = ("HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE",
                      "OMPI_MCA_orte_default_hostfile",
                      "OMPI_MCA_prte_default_hostfile")


def platform_hostfile(environ):
    """(variable, path) of the first hostfile a platform names in
    `environ` (PLATFORM_HOSTFILES), or None."""
    for name in PLATFORM_HOSTFILES:
        path = environ.get(name, "").strip()
        if path:
            return name, path
    return None
