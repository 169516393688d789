"""What a lost rank costs on one host: recovery in place against today's
relaunch, alternating in one run.

    python benchmarks/recovery.py [--rounds 3] [--kill-step 7]

Both paths run tests/workers/recovery_worker.py (PyTorch SGD under
`kerasdist.elastic.run`, 3 ranks, a commit every 3 steps, 12 steps) and
rank 2 SIGKILLs itself mid-step (after its gradient, before its
allreduce):

- in place: kerasdist built against Open MPI (tests/support/site_mpi.py,
  built once into a temporary directory) under `kerasdist run
  --recover-in-place`; the survivors re-form at 2 ranks from the commit in
  memory.
- in place (TCP): the repository's build (no Open MPI, no ULFM) under
  `kerasdist run --nproc-per-node 3 --recover-in-place` with
  KERASDIST_TRANSPORT=tcp; the survivors re-form through the rendezvous.
- relaunch: the repository's build (the mpich wheel) under `kerasdist run
  --max-restarts 1`, the commits on disk (KERASDIST_ELASTIC_DIR): the
  heartbeat ends the survivors, the launcher relaunches 3 ranks, which
  resume from the last commit on disk.

From the wall times the worker records (time.time(), one host's clock):

- total: from the SIGKILL to the first step completed after it (the
  earliest rank's);
- in place, split: detect (SIGKILL to the first survivor's
  RanksLostError), re-form (from there to the reset callbacks: the shrink,
  kd.init() on the survivors, the restore) and the rest (sync and the
  step);
- relaunch, split: down (SIGKILL to the relaunched ranks' script start:
  detection, the job's teardown, the launcher's relaunch), start (to
  kd.init() returning: Python, PyTorch and kerasdist's imports, MPI's
  start) and the rest (reading the commit, syncing, the step);
- lost: steps trained before the kill that are trained again (the kill's
  step minus the commit's).

Prints a Markdown table and the raw figures (JSON).

    python benchmarks/recovery.py --shrink [--rounds 3]

A shrink instead (docs/failures-and-elastic.md, "Shrinking in place"): 3
ranks of the same worker under a discovery script (interval 0.5 s) that
lists 2 slots once rank 0 has done 4 steps; from that change to the first
step done at 2 ranks, in place (the Open MPI build, --recover-in-place:
rank 2 leaves at the next commit, ranks 0 and 1 go on) against the
relaunch (the mpich build: every rank commits and exits, the launcher
starts 2), taking turns.

    python benchmarks/recovery.py --grow [--rounds 3]

A grow from 2 ranks to 3 instead: the discovery script lists a third slot
once rank 0 has done 4 steps, in place (the Open MPI build, the new rank
spawned at a commit) against the relaunch (the mpich build); and over
TCP a process started by `kerasdist run --join` as that happens, or by
the launcher itself from the same discovery script (`kerasdist run -np
2` over TCP), which comes in at the ranks' next commit. From the change
(the join's start) to the new rank's first step, and rank 0's longest
pause between two steps (the training the grow cost the old ranks),
taking turns.

    python benchmarks/recovery.py --steady [--rounds 3]

The steady state instead: what the recoverable transport costs a job with
no failure. 2 ranks allreduce float32 Sum of 4 KiB, 64 KiB (the
shared-memory slots carry it wherever they are on: what differs is the
negotiation) and 16 MiB through the core (kerasdist._core.host, no
framework), each call after a barrier; the median over calls of the
slower rank's time, for the Open MPI build under `kerasdist run` and
under `kerasdist run --recover-in-place`, the mpich build, and the TCP
transport with --recover-in-place (node mode, and `kerasdist run -np
2`); then mpich's MPI and the TCP transport each carrying the data alone (the
single-host shm and cma backends off), taking turns.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

KILL_RANK, NP = 2, 3
TCP = {"KERASDIST_TRANSPORT": "tcp"}
# The single-host backends off: the last resort (MPI's, or TCP's) carries
# the data.
NO_SHM = {"KERASDIST_SHM_ALLREDUCE": "0", "KERASDIST_CMA_ALLREDUCE": "0"}


def _run(args, root, directory, kill_step, extra_env, timeout_s=300):
    from tests.support.helpers import launcher_env
    from tests.support.helpers import worker_cmd
    argv = [sys.executable, "-m", "kerasdist.run", *args, "-np", str(NP),
            *worker_cmd("recovery_worker.py", directory, str(KILL_RANK),
                        str(kill_step))]
    env = launcher_env(dict(os.environ, **extra_env), root)
    out = subprocess.run(argv, capture_output=True, text=True, env=env,
                         cwd=root or REPO, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{args} exited {out.returncode}:\n"
                           f"{(out.stdout + out.stderr)[-3000:]}")
    return out


def _read(directory, name):
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def _first_step_after(ends, kill_at):
    return min(t for e in ends for t in e["done_at"].values() if t > kill_at)


def in_place(root, kill_step, workdir):
    d = tempfile.mkdtemp(dir=workdir)
    _run(["--recover-in-place"], root, d, kill_step, {})
    return _in_place_split(d, kill_step)


def _in_place_split(d, kill_step):
    """The in-place paths' figures from the worker's files in `d`."""
    kill_at = _read(d, "kill.json")["at"]
    ends = [_read(d, f"end.{r}.json") for r in range(NP) if r != KILL_RANK]
    lost_at = min(t for e in ends for t in e["lost_at"])
    reset_at = min(t for e in ends for t in e["reset_at"])
    first = _first_step_after(ends, kill_at)
    return {"total": first - kill_at, "detect": lost_at - kill_at,
            "reform": reset_at - lost_at, "rest": first - reset_at,
            "lost_steps": kill_step - ends[0]["resumed"][0]}


def in_place_tcp(kill_step, workdir):
    """In place over the TCP transport: the repository's build, node mode
    (no MPI, no ULFM)."""
    d = tempfile.mkdtemp(dir=workdir)
    _run(["--nproc-per-node", str(NP), "--recover-in-place"], None, d,
         kill_step, TCP)
    return _in_place_split(d, kill_step)


def relaunch(kill_step, workdir):
    d = tempfile.mkdtemp(dir=workdir)
    commits = os.path.join(d, "commits")
    os.makedirs(commits)
    _run(["--max-restarts", "1"], None, d, kill_step,
         {"KERASDIST_ELASTIC_DIR": commits})
    kill_at = _read(d, "kill.json")["at"]
    starts = [_read(d, f"a1.start.{r}.json") for r in range(NP)]
    ends = [_read(d, f"a1.end.{r}.json") for r in range(NP)]
    began = min(s["began"] for s in starts)
    init_at = max(s["init_at"] for s in starts)
    first = _first_step_after(ends, kill_at)
    committed = min(int(s) for s in ends[0]["done_at"]) - 1
    return {"total": first - kill_at, "down": began - kill_at,
            "start": init_at - began, "rest": first - init_at,
            "lost_steps": kill_step - committed}


def _shrink(root, args, workdir, was=3, now=2, extra_env=None):
    """A job of `was` ranks whose discovery script lists `now` slots once
    rank 0 has done 4 steps; returns its directory."""
    from tests.support.helpers import launcher_env
    from tests.support.helpers import worker_cmd
    d = tempfile.mkdtemp(dir=workdir)
    listed = os.path.join(d, "hosts.txt")
    with open(listed, "w") as f:
        f.write(f"localhost:{was}\n")
    script = os.path.join(d, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {listed}\n")
    os.chmod(script, 0o755)
    argv = [sys.executable, "-m", "kerasdist.run", *args,
            "--host-discovery-script", script, "--min-np", "2",
            "--max-np", "3", "--discovery-interval", "0.5", "-np", str(was),
            *worker_cmd("recovery_worker.py", d)]
    env = launcher_env(dict(os.environ, RECOVERY_GROW_AT="4",
                            RECOVERY_GROW_LIST=listed,
                            RECOVERY_GROW_TO=f"localhost:{now}\n",
                            RECOVERY_RESIZE_SIZE=str(now),
                            **(extra_env or {})), root)
    out = subprocess.run(argv, capture_output=True, text=True, env=env,
                         cwd=root or REPO, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{args} exited {out.returncode}:\n"
                           f"{(out.stdout + out.stderr)[-3000:]}")
    return d


def shrink_in_place(root, workdir):
    """From the discovery script's change to the first step at 2 ranks,
    split: asked (the launcher noticed and signalled), commit (the ranks
    reached their next commit), re-form and step (the split, kd.init() on
    the two, the reset, one step)."""
    d = _shrink(root, ["--recover-in-place"], workdir)
    asked = _read(d, "asked.json")
    commit = _read(d, "left.2.json")["step"]
    done = _read(d, "end.0.json")["done_at"]
    first = done[str(commit + 1)]
    return {"total": first - asked["listed"],
            "asked": asked["at"] - asked["listed"],
            "commit": done[str(commit)] - asked["at"],
            "rest": first - done[str(commit)]}


def shrink_relaunch(workdir):
    """The same job on the repository's build (mpich) without
    --recover-in-place: the ranks commit, exit 76 and are relaunched at
    2; split: asked, commit, and the relaunch to its first step."""
    d = _shrink(None, [], workdir)
    asked = _read(d, "asked.json")
    # The worker's record of a rank that ended by SystemExit (the resize).
    done = _read(d, "left.0.json")["done_at"]
    commit = max(int(k) for k in done)
    first = min(_read(d, "a1.end.0.json")["done_at"].values())
    return {"total": first - asked["listed"],
            "asked": asked["at"] - asked["listed"],
            "commit": done[str(commit)] - asked["at"],
            "rest": first - done[str(commit)]}


def shrink_main(root, rounds, workdir):
    rows = {"in place": [], "relaunch": []}
    for i in range(rounds):
        rows["in place"].append(shrink_in_place(root, workdir))
        rows["relaunch"].append(shrink_relaunch(workdir))
        print(f"round {i + 1}: in place {rows['in place'][-1]['total']:.3f}"
              f" s, relaunch {rows['relaunch'][-1]['total']:.3f} s",
              flush=True)
    print("\n| path | listed to the first step at 2 (median) | split "
          "(median) |")
    print("|---|---|---|")
    for name, r in rows.items():
        rest = "re-form and step" if name == "in place" else \
            "relaunch and step"
        print(f"| {name} | {_median(r, 'total'):.2f} s | asked "
              f"{_median(r, 'asked'):.2f} s, to the commit "
              f"{_median(r, 'commit'):.2f} s, {rest} "
              f"{_median(r, 'rest'):.2f} s |")
    print("\nraw:", json.dumps(rows, indent=1))


def _pause(done_at):
    """The longest wait between two steps of a rank (its done_at)."""
    times = sorted(done_at.values())
    return max(b - a for a, b in zip(times, times[1:]))


def _grow(root, args, workdir, first_at_3):
    """2 ranks that the discovery script grows to 3 at step 4: from the
    change to the first step at 3 (`first_at_3`: the end file that has
    it), split: asked (the launcher noticed and signalled), then the
    rest; and rank 0's pause (the longest wait between two of its steps;
    across the relaunch, from its last step to its first after)."""
    d = _shrink(root, args, workdir, 2, 3)
    asked = _read(d, "asked.json")
    first = min(_read(d, first_at_3)["done_at"].values())
    if first_at_3.startswith("a1."):
        pause = first - max(_read(d, "left.0.json")["done_at"].values())
    else:
        pause = _pause(_read(d, "end.0.json")["done_at"])
    return {"total": first - asked["listed"],
            "asked": asked["at"] - asked["listed"],
            "rest": first - asked["at"], "pause": pause}


def grow_in_place(root, workdir):
    """The Open MPI build under --recover-in-place: the ranks start the
    new one at a commit (MPI_Comm_spawn) and re-form with it."""
    return _grow(root, ["--recover-in-place"], workdir, "end.2.json")


def grow_relaunch(workdir):
    """The repository's build (mpich) without --recover-in-place: the
    ranks commit, exit 76 and are relaunched at 3."""
    return _grow(None, [], workdir, "a1.end.0.json")


def grow_discovered_tcp(workdir):
    """Over TCP, `kerasdist run -np 2 --recover-in-place` with the
    discovery script: the launcher starts the third process itself
    (kerasdist/run/tcp_launch.py), which comes in at the ranks' next
    commit; from the change to its first step."""
    d = _shrink(None, ["--recover-in-place"], workdir, 2, 3,
                dict(TCP, RECOVERY_GROW_JOIN="1"))
    listed = _read(d, "asked.json")["listed"]
    joined = _read(d, "start.2.json")
    first = min(_read(d, "end.2.json")["done_at"].values())
    return {"total": first - listed, "start": joined["began"] - listed,
            "in": joined["init_at"] - joined["began"],
            "rest": first - joined["init_at"],
            "pause": _pause(_read(d, "end.0.json")["done_at"])}


def grow_join(workdir):
    """Over TCP: `kerasdist run --nproc-per-node 2 --recover-in-place`,
    and once rank 0 has done 4 steps `kerasdist run --join` starts a
    third process: from that launcher's start to the process's first
    step, split: to its script's start, to its kd.init() returning (its
    imports, the wait for the ranks' next commit, the re-form), and its
    first step."""
    from tests.support.helpers import free_port
    from tests.support.helpers import launcher_env
    from tests.support.helpers import worker_cmd
    from tests.support.recovery import run_with_join
    d = tempfile.mkdtemp(dir=workdir)
    listed = os.path.join(d, "join-now")
    port = free_port()
    env = launcher_env(dict(os.environ, RECOVERY_GROW_AT="4",
                            RECOVERY_GROW_LIST=listed, RECOVERY_GROW_JOIN="1",
                            KERASDIST_JOB_SECRET="b" * 32, **TCP), None)
    procs, outs, began = run_with_join(
        worker_cmd("recovery_worker.py", d), env, port, listed, 300)
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(o[-3000:] for o in outs))
    joined = _read(d, "start.2.json")
    first = min(_read(d, "end.2.json")["done_at"].values())
    return {"total": first - began[-1], "start": joined["began"] -
            began[-1], "in": joined["init_at"] - joined["began"],
            "rest": first - joined["init_at"],
            "pause": _pause(_read(d, "end.0.json")["done_at"])}


def grow_main(root, rounds, workdir):
    rows = {"in place (ULFM)": [], "in place (TCP, --join)": [],
            "in place (TCP, discovery)": [], "relaunch": []}
    for i in range(rounds):
        rows["in place (ULFM)"].append(grow_in_place(root, workdir))
        rows["in place (TCP, --join)"].append(grow_join(workdir))
        rows["in place (TCP, discovery)"].append(
            grow_discovered_tcp(workdir))
        rows["relaunch"].append(grow_relaunch(workdir))
        print(f"round {i + 1}: " + ", ".join(
            f"{k} {v[-1]['total']:.3f} s" for k, v in rows.items()),
            flush=True)
    print("\n| path | from the change to the new rank's first step "
          "(median) | split (median) | rank 0's longest pause (median) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        if name.startswith("in place (TCP"):
            what = "change" if "discovery" in name else "launcher"
            split = (f"{what} to script {_median(r, 'start'):.2f} s, "
                     f"script to let in {_median(r, 'in'):.2f} s, to its "
                     f"first step {_median(r, 'rest'):.2f} s")
        else:
            split = (f"asked {_median(r, 'asked'):.2f} s, then "
                     f"{_median(r, 'rest'):.2f} s")
        print(f"| {name} | {_median(r, 'total'):.2f} s | {split} | "
              f"{_median(r, 'pause'):.2f} s |")
    print("\nraw:", json.dumps(rows, indent=1))


STEADY = """
import json, sys, time
import numpy as np
import kerasdist as kd
from kerasdist._core import host
kd.init()
out = {}
for nbytes, calls in ((4096, 400), (64 << 10, 200), (16 << 20, 20)):
    x = np.ones(nbytes // 4, np.float32)
    for i in range(5):
        host.host_allreduce(x, kd.Sum, f"warm.{nbytes}.{i}")
    times = []
    for i in range(calls):
        host.host_barrier(f"b.{nbytes}.{i}")
        t = time.perf_counter()
        host.host_allreduce(x, kd.Sum, f"a.{nbytes}.{i}")
        times.append(time.perf_counter() - t)
    slowest = host.host_allreduce(np.array(times), kd.Max, f"max.{nbytes}")
    out[nbytes] = float(np.median(slowest))
if kd.rank() == 0:
    print("STEADY " + json.dumps(out), flush=True)
"""


def steady(root, args, extra_env=None):
    from tests.support.helpers import launcher_env
    argv = [sys.executable, "-m", "kerasdist.run", *args, "-np", "2",
            sys.executable, "-c", STEADY]
    env = launcher_env(dict(os.environ, **(extra_env or {})), root)
    out = subprocess.run(argv, capture_output=True, text=True, env=env,
                         cwd=root or REPO, timeout=300)
    for line in out.stdout.splitlines():
        if "STEADY " in line:
            return {int(k): v for k, v in
                    json.loads(line.split("STEADY ", 1)[1]).items()}
    raise RuntimeError(f"{args}: {(out.stdout + out.stderr)[-3000:]}")


def steady_main(root, rounds):
    node = ["--nproc-per-node", "2"]
    systems = {"Open MPI": (root, [], {}),
               "Open MPI --recover-in-place": (root, ["--recover-in-place"],
                                               {}),
               "mpich": (None, [], {}),
               "TCP --recover-in-place": (None, node + ["--recover-in-place"],
                                          TCP),
               "TCP -np --recover-in-place": (None, ["--recover-in-place"],
                                              TCP),
               "mpich, no shm/cma": (None, [], NO_SHM),
               "TCP, no shm/cma": (None, node, dict(TCP, **NO_SHM))}
    rows = {name: [] for name in systems}
    for i in range(rounds):
        for name, (where, args, env) in systems.items():
            rows[name].append(steady(where, args, env))
        print(f"round {i + 1}: " + ", ".join(
            f"{n} {r[-1][4096] * 1e6:.0f} us / {r[-1][16 << 20] * 1e3:.1f} ms"
            for n, r in rows.items()), flush=True)
    print("\n| system | 4 KiB allreduce (median) | 64 KiB (median) | "
          "16 MiB (median) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        small = statistics.median(x[4096] for x in r)
        mid = statistics.median(x[64 << 10] for x in r)
        big = statistics.median(x[16 << 20] for x in r)
        print(f"| {name} | {small * 1e6:.0f} us | {mid * 1e6:.0f} us | "
              f"{big * 1e3:.2f} ms |")
    print("\nraw:", json.dumps(rows))


def _median(rows, key):
    return statistics.median(r[key] for r in rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=7)
    p.add_argument("--steady", action="store_true",
                   help="the steady state's allreduce times instead")
    p.add_argument("--shrink", action="store_true",
                   help="a shrink from 3 ranks to 2 (discovery) instead")
    p.add_argument("--grow", action="store_true",
                   help="a grow from 2 ranks to 3 instead: discovery "
                   "(ULFM, relaunch) and a process that joins (TCP)")
    args = p.parse_args()
    from tests.support import site_mpi
    home = site_mpi.openmpi_home()
    if home is None:
        sys.exit(f"no Open MPI: {site_mpi.OPENMPI_INSTALL}")
    with tempfile.TemporaryDirectory() as workdir:
        root = site_mpi.build(os.path.join(workdir, "openmpi-build"),
                              KERASDIST_MPI_HOME=home)
        if args.steady:
            steady_main(root, args.rounds)
            return
        if args.shrink:
            shrink_main(root, args.rounds, workdir)
            return
        if args.grow:
            grow_main(root, args.rounds, workdir)
            return
        rows = {"in place": [], "in place (TCP)": [], "relaunch": []}
        for i in range(args.rounds):
            rows["in place"].append(in_place(root, args.kill_step, workdir))
            rows["in place (TCP)"].append(in_place_tcp(args.kill_step,
                                                       workdir))
            rows["relaunch"].append(relaunch(args.kill_step, workdir))
            print(f"round {i + 1}: " + ", ".join(
                f"{k} {v[-1]['total']:.3f} s" for k, v in rows.items()),
                flush=True)
    rl = rows["relaunch"]
    print()
    print("| path | SIGKILL to next step (median) | split (median) | "
          "steps trained again |")
    print("|---|---|---|---|")
    for name in ("in place", "in place (TCP)"):
        ip = rows[name]
        print(f"| {name} | {_median(ip, 'total'):.3f} s | detect "
              f"{_median(ip, 'detect'):.3f} s, re-form "
              f"{_median(ip, 'reform'):.3f} s, sync and step "
              f"{_median(ip, 'rest'):.3f} s | {ip[0]['lost_steps']} |")
    print(f"| relaunch | {_median(rl, 'total'):.3f} s | detect and "
          f"relaunch {_median(rl, 'down'):.3f} s, start "
          f"{_median(rl, 'start'):.3f} s, resume and step "
          f"{_median(rl, 'rest'):.3f} s | {rl[0]['lost_steps']} |")
    for name in ("in place", "in place (TCP)"):
        print(f"\nrelaunch / {name}: "
              f"{_median(rl, 'total') / _median(rows[name], 'total'):.1f}x")
    print("\nraw:", json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
