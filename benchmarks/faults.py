"""What a fault costs a Trainer job across two test hosts (tests/cluster;
needs root), with the default heartbeat (30 s timeout, 1 s interval).

    python benchmarks/faults.py [--faults kill,exception,freeze,drop,link_down]
        [--heartbeat-timeout 30] [--rounds 1]

Each fault strikes kdt1's rank (of 2, one a host) after optimizer step 22
of 45 (tests/workers/trainer_fault_worker.py, step checkpoints every 4
steps) under `kerasdist run --max-restarts 1`; the host faults (drop,
link_down) with `--min-np 1`, so the job goes on at one rank on kdt0. From
the lines of the launcher's output, timed as they arrive:

- detect: from the faulting rank's last line ("does X" / "kills itself",
  printed just before the fault) to the launcher's line that stops the job;
- resume: from the fault to the Trainer's "resuming from" line of the
  relaunched job (its ranks have imported TensorFlow, built the model and
  loaded the checkpoint; its first step follows);
- lost: optimizer steps trained before the fault that the resumed job
  trains again (22 minus the step of the checkpoint it resumed from).

Run it alone: a busy machine makes the restart part longer.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FAULT_STEP = 22
_STRUCK = re.compile(r"worker: rank \d+ (does \w+|kills itself)")
_STOPPING = re.compile(r"^kerasdist: .*(stopping the other ranks|lost )")
_RESUMED = re.compile(r"resuming from .*\(optimizer step (\d+)\)")


def one(cluster, fault, timeout_s, workdir):
    from tests.support.helpers import launcher_env
    from tests.support.helpers import worker_cmd
    from tests.support.helpers import worker_env

    how = "kill" if fault == "kill" else fault
    args = ["--max-restarts", "1"] + (
        ["--min-np", "1"] if fault in ("drop", "link_down") else [])
    argv = [*cluster.launcher_prefix(), sys.executable, "-m", "kerasdist.run",
            "--ssh-command", cluster.remote_shell, "--network-interface",
            cluster.bridge, "-H", "kdt0:1,kdt1:1", *args, "-np", "2",
            *worker_cmd("trainer_fault_worker.py", "run",
                        os.path.join(workdir, fault), workdir, "--tag", fault,
                        "--kill-rank", "1", "--kill-step", str(FAULT_STEP),
                        "--kill-how", how)]
    env = launcher_env(worker_env(
        KERASDIST_HEARTBEAT_TIMEOUT_SECONDS=timeout_s))
    marks = {}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO)
    try:
        for line in proc.stdout:
            now = time.monotonic()
            if "struck" not in marks and _STRUCK.search(line):
                marks["struck"] = now
            elif "struck" in marks and "stop" not in marks and \
                    _STOPPING.search(line):
                marks["stop"] = now
            m = _RESUMED.search(line)
            if m and "resume" not in marks:
                marks["resume"] = now
                marks["from_step"] = int(m.group(1))
        rc = proc.wait(timeout=600)
    finally:
        proc.kill()
        cluster.restore(cluster.host("kdt1"))
        cluster.undrop(cluster.host("kdt1"))
    if rc != 0 or len(marks) < 4:
        raise SystemExit(f"{fault}: exit {rc}, marks {sorted(marks)}")
    return (marks["stop"] - marks["struck"], marks["resume"] - marks["struck"],
            FAULT_STEP - marks["from_step"])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--faults", default="kill,exception,freeze,drop,link_down")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    from tests.support.cluster import Cluster
    from tests.support.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"faults.py needs a test cluster: {reason}")
    results = {f: [] for f in args.faults.split(",")}
    with Cluster(2) as cluster, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for fault in results:
                work = os.path.join(tmp, f"{fault}-{r}")
                os.makedirs(work)
                results[fault].append(one(cluster, fault,
                                          args.heartbeat_timeout, work))
                print(f"# round {r + 1} {fault}: {results[fault][-1]}",
                      flush=True)
    print(f"# heartbeat timeout {args.heartbeat_timeout:g} s; medians over "
          f"{args.rounds} round(s)")
    print(f"{'fault':<12} {'detect (s)':>11} {'resume (s)':>11} "
          f"{'lost (steps)':>13}")
    for fault, rows in results.items():
        det, res, lost = (statistics.median(c) for c in zip(*rows))
        print(f"{fault:<12} {det:>11.1f} {res:>11.1f} {lost:>13.0f}")


if __name__ == "__main__":
    main()
