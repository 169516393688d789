"""What the recovery-in-place tests (tests/cluster/test_recovery*.py)
share: tests/workers/recovery_worker.py's data and step as a module, its
training in numpy (the truth), and the JSON files its ranks write."""

import importlib.util
import json
import os

from tests.support.helpers import WORKERS


def worker_module(name="recovery_worker"):
    """tests/workers/<name>.py, imported (its data and step)."""
    path = os.path.join(WORKERS, name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sgd(m, w, first, last, size):
    """The worker `m`'s steps first..last-1 at `size` ranks, in numpy,
    from the weights `w`."""
    x, y = m.data()
    for step in range(first, last):
        g = sum(m.gradient(w, x, y, m.rows_for(step, r, size))
                for r in range(size)) / size
        w = w - m.LR * g
    return w


def read_json(directory, name):
    """The JSON file `name` a rank wrote in `directory`."""
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def grown_ends(out, directory, why):
    """The end.<rank>.json of the 3 ranks of a job that grew from 2 to 3
    ranks in place (rank 0 said so, `why` its reason, in `out`, the
    launcher's output, with no second attempt), after checking that
    ranks 0 and 1 kept their processes and rank 2 started at 3 ranks."""
    assert out.returncode == 0, out.stdout
    assert (f"grew in place to 3 rank(s) (was 2; {why}): the new ranks "
            f"started in " in out.stdout), out.stdout
    assert "attempt 2" not in out.stdout, out.stdout
    assert read_json(directory, "asked.json")["heard"], out.stdout
    return grown_files(directory)


def grown_files(directory):
    """The 3 end files of a job grown from 2 ranks to 3, after checking
    that ranks 0 and 1 kept their processes and resumed once, from the
    commit the job grew at, and rank 2 started at 3 ranks."""
    ends = [read_json(directory, f"end.{rank}.json") for rank in range(3)]
    commit = ends[0]["resumed"][0]
    for rank, end in enumerate(ends):
        start = read_json(directory, f"start.{rank}.json")
        assert (end["pid"], end["rank"], end["size"]) == (
            start["pid"], rank, 3), (start, end)
        assert start["size"] == (2 if rank < 2 else 3), start
        assert end["resumed"] == ([commit] if rank < 2 else []), end
    return ends


def check_survivors(directory, survivors, kill_step, steps, every):
    """After a rank lost at `kill_step` (of `steps`, a commit every
    `every`): each of `survivors` (start ranks, in order) kept its process,
    is now rank i of len(survivors), resumed once from the last commit,
    and holds numpy's weights for that commit (made at 3 ranks) continued
    at the smaller size. Returns the commit's step."""
    import numpy as np
    commit = kill_step // every * every
    m = worker_module()
    truth = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, commit, 3), commit,
                steps, len(survivors))
    for new_rank, rank in enumerate(survivors):
        start = read_json(directory, f"start.{rank}.json")
        end = read_json(directory, f"end.{rank}.json")
        assert (start["size"], end["pid"], end["rank"], end["size"],
                end["resumed"]) == (3, start["pid"], new_rank,
                                    len(survivors), [commit]), (start, end)
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)
    return commit


def check_grown_weights(ends, steps, every, grow_at):
    """After a job grew from 2 ranks to 3 at the commit rank 0 resumed
    from (`ends`: the 3 end files, in rank order): ranks 0 and 1 trained
    from step 1, rank 2 from the commit on, and every rank holds numpy's
    weights for the steps up to that commit at 2 ranks and the rest (at
    least 6, up to `steps`) at 3. Returns the commit's step."""
    import numpy as np
    commit = ends[0]["resumed"][0]
    last = max(steps, commit + 6)
    assert commit % every == 0 and commit > grow_at, ends[0]
    m = worker_module()
    truth = sgd(m, sgd(m, np.zeros(m.FEATURES), 0, commit, 2), commit,
                last, 3)
    assert not np.allclose(truth, sgd(m, np.zeros(m.FEATURES), 0, last, 2),
                           rtol=1e-6, atol=0)
    for rank, end in enumerate(ends):
        assert sorted(map(int, end["done_at"])) == list(
            range(1 if rank < 2 else commit + 1, last + 1)), end
        np.testing.assert_allclose(end["w"], truth, rtol=1e-12, atol=1e-12)
    return commit


def joining_envs(port, listed, master, **extra):
    """The environments of ranks 0 and 1 of a TCP job that recovers in
    place (torchrun's variables, coordinator `master`:`port`) and of a
    process that joins it (KERASDIST_JOIN=1), for recovery_worker.py with
    rank 0 writing `listed` once it trained a few steps."""
    from tests.support.helpers import worker_env
    common = dict(
        MASTER_ADDR=master, MASTER_PORT=port, KERASDIST_TRANSPORT="tcp",
        KERASDIST_RECOVER_IN_PLACE=1, KERASDIST_JOB_SECRET="j" * 32,
        RECOVERY_GROW_LIST=listed, RECOVERY_GROW_JOIN=1, **extra)
    common.setdefault("RECOVERY_BACKEND", "torch")
    envs = [worker_env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=r,
                       LOCAL_WORLD_SIZE=2, **common) for r in range(2)]
    envs.append(worker_env(KERASDIST_JOIN=1, **common))
    for env in envs:
        env.pop("KERASDIST_ELASTIC_DIR", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        envs[2].pop(k, None)
    return envs


def run_joining(starts, listed, timeout):
    """Calls each of `starts` but the last (each starts processes of the
    job: a Popen with its output piped, rank 0's first), then, once rank
    0 wrote `listed`, the last (the joining process); returns the Popens
    and their outputs. Each is killed whole on leaving."""
    import time

    from tests.support.helpers import kill_tree
    procs = []
    try:
        procs += [start() for start in starts[:-1]]
        deadline = time.monotonic() + 120
        while not os.path.exists(listed):  # rank 0 trained a few steps
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise AssertionError(procs[0].communicate(timeout=60)[0])
            time.sleep(0.05)
        procs.append(starts[-1]())
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    return procs, outs


def check_joined(procs, outs, directory, steps, every, grow_at):
    """The job of 2 grew to 3 in place with the joining process (the last
    of `procs`) as rank 2: every process ended well, rank 0 said so (in
    outs[0]), ranks 0 and 1 kept their processes and resumed once from
    the commit the job grew at, and every rank holds numpy's weights
    (check_grown_weights). Returns
    rank 0's line and the joiner's start and end files."""
    text = "\n".join(f"--- process {i} ---\n{o[-3000:]}"
                     for i, o in enumerate(outs))
    assert all(p.returncode == 0 for p in procs), text
    said = ("kerasdist.elastic: grew in place to 3 rank(s) (was 2; 1 "
            "process(es) asked to join): the job re-formed in ")
    line = [x for x in outs[0].splitlines() if said in x]
    assert line, text
    ends = grown_files(directory)
    check_grown_weights(ends, steps, every, grow_at)
    return line[0], read_json(directory, "start.2.json"), ends[2]


def run_with_join(command, env, port, listed, timeout):
    """`kerasdist run --nproc-per-node 2 --recover-in-place COMMAND` with
    `env` (KERASDIST_TRANSPORT=tcp and a secret in it), coordinator
    127.0.0.1:`port`, then, once its rank 0 wrote `listed`, `kerasdist
    run --nproc-per-node 1 --join COMMAND`: (the two launchers' Popens,
    their outputs, the wall time each was started)."""
    import subprocess
    import sys
    import time

    from tests.support.helpers import REPO_ROOT
    started = []

    def start(*flags):
        started.append(time.time())
        return subprocess.Popen(
            [sys.executable, "-m", "kerasdist.run", "--master-addr",
             "127.0.0.1", "--master-port", str(port), *flags, *command],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, cwd=REPO_ROOT, start_new_session=True)
    procs, outs = run_joining([
        lambda: start("--nproc-per-node", "2", "--recover-in-place"),
        lambda: start("--nproc-per-node", "1", "--join")], listed, timeout)
    return procs, outs, started
