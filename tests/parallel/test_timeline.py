"""Timelines written by real ranks: valid JSON, rows named after the
tensors, the phases of each, start/stop at run time, and the summary."""

import json
import os
import sys

import pytest

from kerasdist.tools import timeline as timeline_tools
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import launch
from tests.support.helpers import rank_env
from tests.support.helpers import rank_lines

pytestmark = [pytest.mark.parallel, pytest.mark.slow]

WORKER = os.path.join(REPO_ROOT, "tests", "workers", "timeline_worker.py")


def _env(**extra):
    return rank_env(drop=("KERASDIST_TIMELINE",
                          "KERASDIST_TIMELINE_MARK_CYCLES"), **extra)


def _ok(out, np_):
    assert out.returncode == 0, out.stdout[-4000:]
    for r in range(np_):
        assert "OK" in rank_lines(out.stdout, r), out.stdout[-4000:]


def _rows(events):
    """tensor name -> set of phase names on its row."""
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    rows = {}
    for e in events:
        if e.get("ph") == "X":
            rows.setdefault(names[e["tid"]], set()).add(e["name"])
    return rows


def test_env_timeline_rows_and_phases(tmp_path):
    path = tmp_path / "trace.json"
    out = launch(2, [sys.executable, WORKER, "env"], timeout=180,
                 env=_env(KERASDIST_TIMELINE=path))
    _ok(out, 2)
    with open(path) as f:
        events = json.load(f)
    assert any(e.get("name") == "process_name" for e in events)
    rows = _rows(events)
    for i in range(4):
        assert {"NEGOTIATE", "ALLREDUCE"} <= rows[f"tl.grad.{i}"], rows
    fused = rows["tl.grad.0"] | rows["tl.grad.1"]
    assert {"QUEUE", "MEMCPY_IN_FUSION_BUFFER",
            "MEMCPY_OUT_FUSION_BUFFER"} <= fused, fused
    assert "ALLGATHER" in rows["tl.gather"]
    assert "BROADCAST" in rows["tl.bcast"]
    for e in events:
        if e.get("ph") == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
        if e.get("name") == "NEGOTIATE":
            a = e["args"]
            assert len(a["wait_us"]) == 2 and a["last_rank"] in (0, 1)
            assert a["wait_us"][a["first_rank"]] == 0
        if e.get("name") == "ALLREDUCE":
            assert e["args"]["fused"] >= 1 and e["args"]["bytes"] > 0
            # The data-path backend that ran the batch (mpi, shm, cma...).
            assert e["args"]["backend"] and "transport" not in e["args"]
    s = timeline_tools.summarize(str(path))
    assert not s["truncated"]
    n_neg = sum(1 for e in events if e.get("name") == "NEGOTIATE")
    assert sum(r["last"] for r in s["stragglers"].values()) == n_neg
    assert s["tensors"]["tl.grad.1"]["count"] == 5
    # Every float32 step's bytes are counted once, fused or not; the int32
    # tensor (8 elements) is reduced apart.
    assert s["phases"]["ALLREDUCE"]["bytes"] == 5 * ((256 + 1024 + 64) * 4
                                                     + 8 * 4)


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_gradient_rows_named_after_variables(tmp_path, backend):
    # DistributedOptimizer's grouped members are named by position
    # (DistributedOptimizer.group0of1.<i>); their rows carry the variables'
    # paths, the members' names in args.tensor. The path is every
    # framework's (kerasdist/_reduction.py).
    out = launch(2, [sys.executable, WORKER, "fit", str(tmp_path)],
                 timeout=240, env=_env(KERAS_BACKEND=backend))
    _ok(out, 2)
    with open(tmp_path / "fit.json") as f:
        events = json.load(f)
    meta = [e["args"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"]
    labelled = {a["name"]: a["tensor"] for a in meta if "tensor" in a}
    for layer in ("first", "second"):
        for var in ("kernel", "bias"):
            hits = [n for n in labelled if n.endswith(f"{layer}/{var}")]
            assert len(hits) == 1, (layer, var, labelled)
            assert labelled[hits[0]].startswith(
                "DistributedOptimizer.group0of1"), labelled
    # Rows with events are the labelled ones (the names in rows are the
    # labels), and the summary reports them by label.
    rows = _rows(events)
    assert any(n.endswith("first/kernel") for n in rows), rows
    s = timeline_tools.summarize(str(tmp_path / "fit.json"))
    assert any(n.endswith("second/bias") for n in s["tensors"]), s


def test_launcher_flag(tmp_path):
    path = tmp_path / "flag.json"
    out = launch(2, [sys.executable, WORKER, "env"], timeout=180,
                 env=_env(), launcher_args=["--timeline-filename", str(path)])
    _ok(out, 2)
    with open(path) as f:
        assert "tl.grad.0" in _rows(json.load(f))


def test_start_timeline_stop_timeline_at_run_time(tmp_path):
    out = launch(2, [sys.executable, WORKER, "runtime", str(tmp_path)],
                 timeout=180, env=_env())
    _ok(out, 2)
    with open(tmp_path / "a.json") as f:
        a = json.load(f)
    names = set(_rows(a))
    assert {f"inside.{i}" for i in range(4)} <= names, names
    assert not any(n.startswith(("before.", "after.", "second."))
                   for n in names), names
    assert not any(e.get("name") == "CYCLE" for e in a)
    with open(tmp_path / "b.json") as f:
        b = json.load(f)
    assert {f"second.{i}" for i in range(4)} == set(_rows(b))
    assert any(e.get("name") == "CYCLE" and e.get("ph") == "i" for e in b)
    # Only rank 0 writes.
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.json"]
