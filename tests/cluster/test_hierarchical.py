"""Hierarchical allreduce across test hosts (2 x 2 and 2 + 1 ranks): the
`hier` backend is built and runs, its results match numpy and, for integer
Sum, the flat path's bit for bit, the timeline shows its three phases, and
a host's link carries about the 2(H-1)/H x size minimum."""

import json
import os

import numpy as np
import pytest

from tests.support.cluster import Cluster
from tests.support.cluster import require
from tests.support.cluster import run_on
from tests.support.helpers import rank_lines
from tests.support.helpers import worker_cmd
from tests.support.helpers import worker_env

pytestmark = pytest.mark.cluster

LAYOUTS = [(4, "kdt0:2,kdt1:2"), (3, "kdt0:2,kdt1:1")]
PHASES = {"NODE_ALLREDUCE", "CROSS_ALLREDUCE", "NODE_BROADCAST"}


@pytest.fixture(scope="module")
def cluster():
    require()
    with Cluster(2) as c:
        yield c


def _check_job(cluster, np_, hosts, out_dir, hier, timeline=None):
    """Runs the worker's `check` mode; returns {rank: fields of its lines}."""
    os.makedirs(out_dir)
    extra = {"KERASDIST_HIERARCHICAL_ALLREDUCE": int(hier),
             "KERASDIST_HIERARCHICAL_ALLGATHER": int(hier)}
    if timeline:
        extra["KERASDIST_TIMELINE"] = timeline
    out = run_on(cluster, np_, hosts,
                 worker_cmd("hierarchical_worker.py", "check", str(out_dir)),
                 env=worker_env(**extra))
    assert out.returncode == 0, out.stdout[-4000:]
    seen = {}
    for r in range(np_):
        lines = rank_lines(out.stdout, r)
        assert "OK" in lines, (r, lines)
        backends = [l.split()[1] for l in lines if l.startswith("BACKENDS ")]
        runs = [dict(kv.split("=") for kv in l.split()[1:])
                for l in lines if l.startswith("RUNS ")]
        gathers = [int(l.split("=")[1]) for l in lines
                   if l.startswith("GATHERS hier=")]
        assert len(backends) == 1 and len(runs) == 1, lines
        assert len(gathers) == 1, lines
        seen[r] = {"backends": backends[0].split(","),
                   "runs": {k: int(v) for k, v in runs[0].items()},
                   "gathers": gathers[0]}
    return seen


def _rows(trace):
    """Tensor name -> {phase name: [args of its events]} of a trace."""
    with open(trace) as f:
        events = json.load(f)
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    rows = {}
    for e in events:
        if e.get("ph") == "X":
            rows.setdefault(names[e["tid"]], {}).setdefault(
                e["name"], []).append(e.get("args", {}))
    return rows


@pytest.mark.parametrize("np_, hosts", LAYOUTS)
def test_hierarchical_matches_numpy_and_the_flat_path(cluster, tmp_path,
                                                      np_, hosts):
    trace = str(tmp_path / "trace.json")
    hier = _check_job(cluster, np_, hosts, tmp_path / "hier", True, trace)
    flat = _check_job(cluster, np_, hosts, tmp_path / "flat", False)
    for r in range(np_):
        assert "hier" in hier[r]["backends"], hier[r]
        assert hier[r]["runs"]["hier"] > 0, hier[r]
        assert "hier" not in flat[r]["backends"], flat[r]
        assert flat[r]["runs"]["hier"] == 0, flat[r]
        assert flat[r]["runs"]["mpi"] > 0, flat[r]
        # Every allgather (2 dtypes x 2 shapes) went hierarchical, or none.
        assert hier[r]["gathers"] == 4, hier[r]
        assert flat[r]["gathers"] == 0, flat[r]
        # Each run's results were checked against numpy in the worker
        # (floats within the summation error bound of any order, so the two
        # runs' floats are at most twice that apart); here: integer results
        # are the flat path's bit for bit.
        a = np.load(tmp_path / "hier" / f"rank{r}.npz")
        b = np.load(tmp_path / "flat" / f"rank{r}.npz")
        assert sorted(a.files) == sorted(b.files)
        for case in a.files:
            assert a[case].dtype == b[case].dtype, case
            if np.issubdtype(a[case].dtype, np.integer):
                assert a[case].tobytes() == b[case].tobytes(), case
        # Every rank got the same bits as every other (a leader's broadcast).
        first = np.load(tmp_path / "hier" / "rank0.npz")
        for case in a.files:
            assert a[case].tobytes() == first[case].tobytes(), (r, case)
    # Rank 0's trace: every allreduce shows the three phases on its row,
    # the middle one (the batch's own event) with backend "hier"; the
    # batches of six tensors went as one (fused).
    rows = _rows(trace)
    for case in ("single.sum.int32.1000", "batch.sum.float64.3"):
        assert PHASES <= set(rows[case]), (case, rows.get(case))
        cross = rows[case]["CROSS_ALLREDUCE"]
        assert cross and all(a["backend"] == "hier" for a in cross), cross
    fused = [a["fused"] for name, row in rows.items()
             if name.startswith("batch.") for a in row["CROSS_ALLREDUCE"]]
    assert max(fused) >= 2, fused


def test_a_hosts_link_carries_about_the_minimum(cluster):
    # 2 hosts: each must send at least 2(H-1)/H x size = size across the
    # link, and hierarchical sends little more (MPI's and the launcher's
    # own messages are a few KiB).
    mib = 16
    size = mib << 20
    hosts = cluster.hosts
    before = {h.name: cluster.tx_bytes(h) for h in hosts}
    out = run_on(cluster, 4, "kdt0:2,kdt1:2",
                 worker_cmd("hierarchical_worker.py", "bytes", str(mib)),
                 env=worker_env(KERASDIST_HIERARCHICAL_ALLREDUCE=1))
    assert out.returncode == 0, out.stdout[-4000:]
    for r in range(4):
        lines = rank_lines(out.stdout, r)
        assert "OK" in lines and "RUNS hier=1" in lines, (r, lines)
    bound = 2 * (len(hosts) - 1) / len(hosts) * size
    for h in hosts:
        sent = cluster.tx_bytes(h) - before[h.name]
        assert bound <= sent < 1.5 * bound, (h.name, sent, bound)
