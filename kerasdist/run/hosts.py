"""Host lists for `kerasdist run`: `-H host1:2,host2:2` and hostfiles,
also the hostfile a platform names for its MPI launcher.

Pure functions; a malformed entry raises ValueError with a message that says
what was expected and what was given.
"""

import re

# A host name or address as mpiexec's -hosts accepts it (no ':' or ',').
_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")


def _slots(text, where):
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"{where}: slots must be a positive integer, got {text!r}"
        )
    return int(text)


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
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(
            f"{what}: cannot read {path!r}: {e.strerror or e}"
        ) from None
    return parse_hostfile_text(text, path)


def merge_hosts(hosts):
    """Adds up the slots of repeated hosts, keeping first-seen order."""
    merged = {}
    for host, slots in hosts:
        merged[host] = merged.get(host, 0) + slots
    return list(merged.items())


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
