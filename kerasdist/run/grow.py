"""Growing and shrinking in place: `kerasdist run --recover-in-place
--host-discovery-script` (docs/failures-and-elastic.md, "Growing in place"
and "Shrinking in place").

When the discovery script lists more slots, the launcher (resize.Watcher)
writes a grow request, then sends its resize request (SIGUSR1) as for a
relaunch; only where the ranks announced that they grow in place
(`hvd.elastic.run`'s " grows=in-place" in its resizable marker line, and
the Trainer's with a replicated state; a Trainer with `shard=` has none,
and a job of it is relaunched at the new size). At
the next commit `hvd.elastic.run` (kerasdist/elastic.py) finds the
request: rank 0 reads it (and removes it), and the ranks start the new
ones themselves (MPI_Comm_spawn, ops/core/transport/mpi_grow.cc) with the
command it names, instead of ending for a relaunch. No rank of the job
restarts; the launcher's attempt goes on at the new size.

The request is `$KERASDIST_ELASTIC_DIR/grow.json` (the directory rank 0
commits to, on the launcher's file system), written atomically:

    {"old_np": 2, "new_np": 3, "why": "host h has 3 slot(s) now, not 2",
     "ranks": [{"rank": 2, "info": ["host=h"], "argv": [...]}]}

Shrinking in place (fewer slots listed) writes the same file with the
ranks that leave instead (`leavers`: on each host the highest ranks beyond
its slots now, every rank of a host no longer listed), which end with exit
code 0 at the next commit while the others split off and go on
(kerasdist/_core/shrink.py), where the ranks said they shrink in place
(" shrinks=in-place": `hvd.elastic.run`, and the Trainer with its commits
in memory, kerasdist/trainer/trainer.py):

    {"old_np": 3, "new_np": 2, "why": "...", "leave": [2]}

A shrink that would leave fewer ranks than the hosts listed hold (another
host listed at the same time) is a relaunch.

Only where every rank runs on this machine (the launcher's, where mpirun
runs): Open MPI 5.0.11's daemons on other hosts fail on MPI_Comm_spawn, a
known bug of Open MPI 5.0 (open-mpi/ompi#13521, #12601: PMIX_ERROR in
prrte's pmix_server_dyn.c, then heap corruption or a segfault that ends
the whole job, seen on the test hosts in 2 of 5 runs; a host added with
"add-host" failed both times). A change elsewhere is a relaunch, as
without --recover-in-place.

Standard library only.
"""

import json
import os
import shutil
import tempfile

from kerasdist.run import _rank
from kerasdist.run import remote

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


def why_not(change, old_hosts, is_local=remote.is_local):
    """Why the job cannot grow in place as `change` asks, or None: Open
    MPI 5.0's daemons on other hosts than this machine's fail on
    MPI_Comm_spawn (see the module's doc)."""
    hosts = new_hosts(change, old_hosts)
    if hosts:
        return (f"Open MPI 5.0's mpirun cannot start ranks on a host it did "
                f"not start the job on ({', '.join(hosts)})")
    remote_hosts = [h for h, _ in change.hosts if not is_local(h)]
    if remote_hosts:
        return (f"Open MPI 5.0's daemons on other hosts than this one "
                f"({', '.join(remote_hosts)}) fail on MPI_Comm_spawn "
                f"(open-mpi/ompi#13521)")
    return None


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


def leavers(old_hosts, new_hosts, old_np, new_np):
    """The ranks that leave when a job of old_np ranks, which mpirun placed
    on `old_hosts` slot by slot, host by host (its -H order), shrinks to
    new_np ranks on `new_hosts` ([(host, slots), ...]): on each host, its
    highest ranks beyond the slots listed for it now (all of them on a host
    no longer listed). None where the ranks that stay would not be new_np
    (a host listed that the job does not run on): that shrink is a
    relaunch."""
    listed, left, rank, leave, kept = dict(new_hosts), old_np, 0, [], 0
    for host, slots in old_hosts or ():
        used = min(slots, left)
        left -= used
        stay = min(used, listed.get(host, 0))
        leave += range(rank + stay, rank + used)
        rank, kept = rank + used, kept + stay
    return leave if kept == new_np and rank == old_np else None


def shrink_request(change, old_hosts):
    """The request of a resize.Change that shrinks in place (see the
    module's doc; "leave" in place of "ranks"), or None where it cannot
    (leavers)."""
    leave = leavers(old_hosts, change.hosts, change.old_np, change.new_np)
    if not leave:
        return None
    return {"old_np": change.old_np, "new_np": change.new_np,
            "why": change.why, "leave": leave}


def write_request(directory, body, name=REQUEST_NAME):
    """Writes `body` to DIRECTORY/NAME (grow.json), atomically."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-grow-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, os.path.join(directory, name))
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
        if change.new_np < change.old_np:
            body = shrink_request(change, old_hosts)
            if body is None:
                return ("the ranks that stay would not fill the hosts "
                        "listed: a host the job does not run on is listed")
            write_request(directory, body)
            return None
        why = why_not(change, old_hosts)
        if why:
            return why
        write_request(directory, request(change, old_hosts, argv))
        return None

    return grow
