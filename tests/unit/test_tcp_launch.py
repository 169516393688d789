"""`kerasdist run -np N` over the TCP transport (kerasdist/run/tcp_launch.py):
the layout and coordinator, the flags it takes, and its job and host
managers as real processes on this machine (the ranks: small Python
programs that report their variables)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.run import launch_config  # noqa: E402
from kerasdist.run import node  # noqa: E402
from kerasdist.run import tcp_launch  # noqa: E402


def test_layout_places_ranks_host_by_host_as_mpiexec_does():
    assert tcp_launch.layout(5, [("a", 2), ("b", 2), ("c", 4)]) == [
        ("a", 2, 0), ("b", 2, 2), ("c", 1, 4)]
    assert tcp_launch.layout(2, [("a", 2), ("b", 2)]) == [("a", 2, 0)]
    assert tcp_launch.layout(3, None) == [("localhost", 3, 0)]


def test_coordinator_is_rank_0s_host_as_the_others_reach_it():
    local = {"localhost", "me"}.__contains__
    addr, port = tcp_launch.coordinator([("localhost", 2, 0)], local)
    assert addr == "127.0.0.1" and 0 < port < 65536
    assert tcp_launch.coordinator([("h0", 2, 0), ("me", 1, 2)], local) == (
        "h0", 29500)
    # Rank 0 here, others elsewhere: this machine's address on the
    # interface named (lo here: no other address is safe to ask for).
    addr, _ = tcp_launch.coordinator([("me", 1, 0), ("h1", 1, 1)], local,
                                     iface="lo")
    assert addr == "127.0.0.1"


def test_the_command_line_carries_the_plan_but_never_the_secret(
        monkeypatch, tmp_path):
    monkeypatch.setenv("KERASDIST_JOB_SECRET", "z" * 40)
    config = launch_config.parse_args(
        ["-np", "3", "-H", "h0:2,h1:2", "--recover-in-place", "x"],
        environ={"KERASDIST_TRANSPORT": "tcp"})
    argv, (addr, port) = tcp_launch.command(
        config, 3, config.hosts, ["wrapper", "--", "x"], ["ssh"],
        str(tmp_path), lambda h: False)
    assert (addr, port) == ("h0", 29500)
    assert not any("z" * 40 in a for a in argv)
    spec = json.loads(argv[-1])
    assert spec["keep"] is True
    first, second = spec["groups"]
    assert first["shell"][:3] == ["ssh", "-o", "BatchMode=yes"]
    assert (first["host"], first["spec"]["first"],
            first["spec"]["plan"]) == ("h0", 0, [2, 0, 2, "h0", 29500, 3])
    assert (second["host"], second["spec"]["first"],
            second["spec"]["plan"]) == ("h1", 2, [2, 1, 1, "h0", 29500, 3])


def test_flags_over_tcp(monkeypatch):
    tcp = {"KERASDIST_TRANSPORT": "tcp"}
    # No ULFM needed: the ranks re-form over TCP.
    assert launch_config.parse_args(
        ["-np", "2", "--recover-in-place", "x"], environ=tcp).recover_in_place
    with pytest.raises(launch_config.UsageError, match=(
            "^KERASDIST_TRANSPORT=tcp inside a Slurm allocation: over TCP "
            "the launcher starts remote ranks with a remote shell")):
        launch_config.parse_args(["-np", "2", "x"], environ=dict(
            tcp, SLURM_JOB_ID="1", SLURM_JOB_NODELIST="n[1-2]",
            SLURM_TASKS_PER_NODE="1(x2)", SLURM_NTASKS="2"))


# One write a line (print's text and newline are two where the output is
# unbuffered, and the ranks share the pipe).
_REPORT = ("import json, os, sys, time\n"
           "os.write(1, json.dumps({k: os.environ.get(k) for k in ('RANK', "
           "'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', "
           "'MASTER_ADDR', 'MASTER_PORT', 'KERASDIST_JOB_SECRET')}).encode()"
           " + b'\\n')\n"
           "time.sleep(float(sys.argv[1]))\n")


def _job(tmp_path, seconds, hosts=(("localhost", 2), ("127.0.0.1", 1))):
    config = launch_config.parse_args(
        ["-np", "3", "x"], environ={"KERASDIST_TRANSPORT": "tcp"})
    argv, _ = tcp_launch.command(
        config, 3, list(hosts), [sys.executable, "-c", _REPORT,
                                 str(seconds)],
        None, str(tmp_path), lambda h: True)
    env = dict(os.environ, KERASDIST_JOB_SECRET="q" * 40)
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_each_host_manager_numbers_its_ranks_and_gets_the_jobs_env(
        tmp_path):
    proc = _job(tmp_path, 0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    ranks = sorted((json.loads(line) for line in out.splitlines()),
                   key=lambda r: int(r["RANK"]))
    assert [(r["RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"],
             r["GROUP_RANK"]) for r in ranks] == [
        ("0", "0", "2", "0"), ("1", "1", "2", "0"), ("2", "0", "1", "1")]
    assert {r["WORLD_SIZE"] for r in ranks} == {"3"}
    assert {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}
    # The secret came on each host manager's standard input.
    assert {r["KERASDIST_JOB_SECRET"] for r in ranks} == {"q" * 40}


def test_a_grow_request_starts_processes_that_join(tmp_path):
    """The watcher's grow over TCP writes a request; the running job
    manager starts the new processes as `kerasdist run --join` would
    (KERASDIST_JOIN=1, no rank: the job numbers them) and removes the
    request, which a relaunch's manager would otherwise serve again."""
    from kerasdist.run import resize

    proc = _job(tmp_path, 3)
    requests = tcp_launch.requests_dir(str(tmp_path))
    grow = tcp_launch.joiner(
        requests, [sys.executable, "-c", _REPORT, "0"], None,
        lambda: ("127.0.0.1", 29999), lambda h: True)
    change = resize.Change(3, 4, [("localhost", 2), ("127.0.0.1", 2)],
                           "host 127.0.0.1 has 2 slot(s) now, not 1")
    assert grow(change, [("localhost", 2), ("127.0.0.1", 1)]) is None
    assert "needs Open MPI's ULFM" in grow(
        resize.Change(3, 2, [("localhost", 2)], "x"), None)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    reports = [json.loads(line) for line in out.splitlines()]
    joined = [r for r in reports if r["RANK"] is None]
    assert [(r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"], r["MASTER_PORT"])
            for r in joined] == [("0", "1", "29999")], reports
    assert len(reports) == 4 and os.listdir(requests) == []


def test_a_signal_reaches_every_hosts_ranks_as_a_line(tmp_path):
    proc = _job(tmp_path, 60)
    seen = [proc.stdout.readline() for _ in range(3)]
    assert all(seen), seen
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert time.monotonic() - began < 10
    assert proc.returncode == 128 + signal.SIGTERM


def test_a_host_manager_whose_launcher_goes_stops_its_ranks(tmp_path):
    """Its standard input closes (the launcher's host gone, or the remote
    shell's connection): it stops its ranks and exits."""
    script = os.path.abspath(tcp_launch.__file__)
    proc = subprocess.Popen([sys.executable, "-I", "-S", script, "--host"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    plan = node.Plan(1, 0, 2, "127.0.0.1", 1, 2)
    proc.stdin.write(json.dumps({
        "spec": {"argv": [sys.executable, "-c", _REPORT, "60"],
                 "plan": list(plan), "first": 0, "port": 1,
                 "stdin_rank": -1},
        "env": {"KERASDIST_JOB_SECRET": "w" * 40}, "cwd": str(tmp_path)})
        + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline() and proc.stdout.readline()
    began = time.monotonic()
    proc.stdin.close()
    proc.wait(timeout=30)
    assert time.monotonic() - began < 10
    assert proc.returncode == 128 + signal.SIGTERM
