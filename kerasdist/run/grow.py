"""Growing in place: `kerasdist run --recover-in-place
--host-discovery-script` (docs/failures-and-elastic.md, "Growing in place").

When the discovery script lists more slots, the launcher (resize.Watcher)
writes a grow request, then sends its resize request (SIGUSR1) as for a
relaunch. At the next commit `hvd.elastic.run` (kerasdist/elastic.py) finds
the request: rank 0 reads it (and removes it), and the ranks start the new
ones themselves (MPI_Comm_spawn, ops/core/transport/mpi_grow.cc) with the
command it names, instead of ending for a relaunch. No rank of the job
restarts; the launcher's attempt goes on at the new size.

The request is `$KERASDIST_ELASTIC_DIR/grow.json` (the directory rank 0
commits to, on the launcher's file system), written atomically:

    {"old_np": 2, "new_np": 3, "why": "host h has 3 slot(s) now, not 2",
     "ranks": [{"rank": 2, "info": ["host=h"], "argv": [...]}]}

Only onto hosts the job runs on: Open MPI 5.0.11's daemons fail when a
spawn adds a host (MPI_Comm_spawn's "add-host" info: PMIX_ERROR in
prrte's pmix_server_dyn.c, then a segfault that ends the job), so a change
that needs a new host is a relaunch, as without --recover-in-place.

`info` is Open MPI's MPI_Comm_spawn info for the rank ("host=h"); `argv` the
rank's command: `env KERASDIST_GROWN_RANK=<rank>
KERASDIST_RECOVER_IN_PLACE=1`, the per-rank wrapper (_rank.py) and the
user's command. A spawned process inherits mpirun's environment, which
holds every rank's settings but the one mpirun's `-x` sets.

Standard library only.
"""

import json
import os
import shutil
import tempfile

from kerasdist.run import _rank

REQUEST_NAME = "grow.json"
GROWN_RANK_ENV = _rank.GROWN_RANK_ENV


def placements(old_hosts, new_hosts, old_np, new_np):
    """[(rank, host, new host?), ...] for ranks old_np..new_np-1: the free
    slots of `new_hosts` ([(host, slots), ...]) in their order, where
    mpirun placed the old_np ranks on `old_hosts` slot by slot, host by
    host (its -H order)."""
    used, left = {}, old_np
    for host, slots in old_hosts or ():
        used[host] = min(slots, left)
        left -= used[host]
    out, rank = [], old_np
    for host, slots in new_hosts:
        for _ in range(max(0, slots - used.get(host, 0))):
            if rank == new_np:
                return out
            out.append((rank, host, host not in used))
            rank += 1
    return out


def new_hosts(change, old_hosts):
    """The hosts the new ranks of `change` would go to that the job does
    not run on, in order."""
    out = []
    for _, host, new in placements(old_hosts, change.hosts, change.old_np,
                                   change.new_np):
        if new and host not in out:
            out.append(host)
    return out


def request(change, old_hosts, argv):
    """The grow request (see the module's doc) of a resize.Change that
    grows onto hosts the job runs on, for ranks that run `argv` (the
    wrapper and the command)."""
    env = shutil.which("env") or "/usr/bin/env"
    ranks = []
    for rank, host, _ in placements(old_hosts, change.hosts, change.old_np,
                                    change.new_np):
        ranks.append({"rank": rank, "info": [f"host={host}"],
                      "argv": [env, f"{GROWN_RANK_ENV}={rank}",
                               f"{_rank.RECOVER_ENV}=1"] + list(argv)})
    return {"old_np": change.old_np, "new_np": change.new_np,
            "why": change.why, "ranks": ranks}


def write_request(directory, body):
    """Writes `body` to DIRECTORY/grow.json, atomically."""
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-grow-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, os.path.join(directory, REQUEST_NAME))
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def writer(config, argv):
    """The resize.Watcher's `grow` for a job of `config` (a LaunchConfig):
    a function (change, old_hosts) that writes the request where rank 0
    finds it and returns None, or returns why the job cannot grow so in
    place (a new host); None where the job does not grow in place."""
    directory = os.environ.get(_rank.ELASTIC_DIR_ENV)
    if not config.recover_in_place or not directory:
        return None

    def grow(change, old_hosts):
        hosts = new_hosts(change, old_hosts)
        if hosts:
            return (f"Open MPI 5.0's mpirun cannot start ranks on a host "
                    f"it did not start the job on ({', '.join(hosts)}: "
                    f"its daemons fail on MPI_Comm_spawn's add-host)")
        write_request(directory, request(change, old_hosts, argv))
        return None

    return grow
