"""MPICH's shared-memory segments that a failed or killed attempt left.

MPICH's ranks on one host share memory through files /dev/shm/mpich_shm_*
that the last rank to detach removes; ranks that die (killed, or ended by
a lost peer) leave them, about 2 MB each, until /dev/shm is full and the
next job dies of SIGBUS. After each attempt the launcher removes those of
its host that the attempt made and that no process maps any more.
"""

import os

SHM_DIR = "/dev/shm"
PREFIX = "mpich_shm_"


def _mapped(directory):
    """The paths under `directory` that some live process maps."""
    found = set()
    start = os.path.join(directory, "")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    at = line.find(b" /")
                    if at >= 0 and start.encode() in line:
                        found.add(line[at + 1:].strip().decode(
                            errors="replace"))
        except OSError:
            continue  # gone, or not ours to read
    return found


def remove_orphans(since, directory=SHM_DIR):
    """Removes `directory`'s MPICH segments owned by this user, made at or
    after `since` (time.time()), that no process maps; returns their
    names."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return []
    candidates = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and st.st_mtime >= since:
            candidates.append(path)
    if not candidates:
        return []
    mapped = _mapped(directory)
    removed = []
    for path in candidates:
        if path in mapped:
            continue
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed
