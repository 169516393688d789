"""Growing in place, the launcher's side (kerasdist/run/grow.py, the
resize.Watcher's `grow`) and the names the rank side shares with it
(kerasdist/_core/grow.py). The real job: tests/cluster/test_recovery.py."""

import io
import json
import os
import signal

from kerasdist._core import grow as rank_grow
from kerasdist.rendezvous import joining
from kerasdist.run import _rank
from kerasdist.run import grow
from kerasdist.run import job
from kerasdist.run import node
from kerasdist.run import resize


def test_grow_rank_side_names_are_the_launchers():
    assert rank_grow.REQUEST_NAME == grow.REQUEST_NAME == "grow.json"
    assert rank_grow.GROWN_RANK_ENV == grow.GROWN_RANK_ENV == \
        _rank.GROWN_RANK_ENV == "KERASDIST_GROWN_RANK"
    assert rank_grow.RECOVER_ENV == _rank.RECOVER_ENV
    assert rank_grow.ELASTIC_DIR_ENV == _rank.ELASTIC_DIR_ENV
    # The stdlib-only launcher's copies of the joining process's name.
    assert _rank.JOIN_ENV == node.JOIN_ENV == joining.JOIN_ENV == \
        "KERASDIST_JOIN"


def test_a_grown_rank_is_prefixed_with_its_rank_in_the_grown_job():
    # Its MPI_COMM_WORLD rank is that of the processes started with it.
    assert _rank.rank_from_env({"KERASDIST_GROWN_RANK": "2",
                                "OMPI_COMM_WORLD_RANK": "0"}) == "2"
    assert _rank.rank_from_env({"OMPI_COMM_WORLD_RANK": "1"}) == "1"


def test_grow_placements_take_the_free_slots_in_the_listed_order():
    # mpirun placed 3 ranks on a:2, b:2 slot by slot: a, a, b.
    assert grow.placements([("a", 2), ("b", 2)], [("a", 2), ("b", 2),
                                                  ("c", 2)], 3, 6) == [
        (3, "b", False), (4, "c", True), (5, "c", True)]
    # One more slot on the same host.
    assert grow.placements([("localhost", 2)], [("localhost", 3)], 2, 3) == [
        (2, "localhost", False)]
    # Up to new_np only.
    assert grow.placements([("a", 1)], [("a", 1), ("b", 4)], 1, 3) == [
        (1, "b", True), (2, "b", True)]


def test_grow_request_names_each_new_rank_its_host_and_command():
    change = resize.Change(2, 4, [("a", 2), ("b", 3)], "host b has 3")
    body = grow.request(change, [("a", 2), ("b", 1)], ["python", "_rank.py",
                                                      "--", "train.py"])
    assert (body["old_np"], body["new_np"], body["why"]) == (
        2, 4, "host b has 3")
    assert [(r["rank"], r["info"]) for r in body["ranks"]] == [
        (2, ["host=b"]), (3, ["host=b"])]
    argv = body["ranks"][1]["argv"]
    assert os.path.basename(argv[0]) == "env" and argv[1:] == [
        "KERASDIST_GROWN_RANK=3", "KERASDIST_RECOVER_IN_PLACE=1", "python",
        "_rank.py", "--", "train.py"]


def test_grow_new_hosts_are_those_the_job_does_not_run_on():
    change = resize.Change(1, 3, [("a", 2), ("b", 2)], "host b joined")
    assert grow.new_hosts(change, [("a", 1)]) == ["b"]
    assert grow.new_hosts(change, [("a", 2)]) == ["b"]
    change = resize.Change(1, 2, [("a", 2), ("b", 2)], "a has 2")
    assert grow.new_hosts(change, [("a", 1)]) == []


class _Proc:
    def __init__(self):
        self.signals = []

    def send_signal(self, signum):
        self.signals.append(signum)


def _grow_watcher(tmp_path, listed):
    out = io.BytesIO()
    directory = str(tmp_path / "elastic")

    def write(change, hosts):
        grow.write_request(directory,
                           grow.request(change, hosts, ["cmd"]))

    w = resize.Watcher(lambda: listed, lambda c: (list(c), []), 2,
                       [("localhost", 2)], 2, 3, 1.0, job.Log(out, out),
                       started=0.0, clock=lambda: 0.0, grow=write)
    return w, out, os.path.join(directory, grow.REQUEST_NAME)


def test_watcher_grows_in_place_and_goes_on_at_the_new_size(tmp_path):
    w, out, path = _grow_watcher(tmp_path, [("localhost", 3)])
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, True)
    # The request written before the signal; the attempt goes on at 3.
    assert proc.signals == [signal.SIGUSR1]
    with open(path) as f:
        body = json.load(f)
    assert [r["rank"] for r in body["ranks"]] == [2]
    assert out.getvalue() == (
        b"kerasdist: growing from 2 to 3 ranks: host localhost has 3 "
        b"slot(s) now, not 2; in place, at the ranks' next commit\n")
    assert (w.np, w.hosts, w.requested) == (3, [("localhost", 3)], None)
    w.poll()
    w.step(2.0, True, proc, True)
    assert proc.signals == [signal.SIGUSR1]  # nothing more to do


def test_watcher_grows_by_relaunching_where_the_ranks_do_not_grow_in_place(
        tmp_path):
    # The Trainer's ranks announce no grows=in-place: no request; the
    # ranks are asked to stop for a relaunch at 3.
    w, out, path = _grow_watcher(tmp_path, [("localhost", 3)])
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, False)
    assert proc.signals == [signal.SIGUSR1] and not os.path.exists(path)
    assert w.requested.new_np == 3
    assert out.getvalue() == (
        b"kerasdist: growing from 2 to 3 ranks: host localhost has 3 "
        b"slot(s) now, not 2\n")


def test_announce_grows_in_place_marker_is_the_launchers(capfdbinary,
                                                         monkeypatch):
    # hvd.elastic.run's announcement says it grows in place; the
    # launcher's relay finds the word in it (the Trainer's has none).
    from kerasdist._core import resize as rank_resize

    assert rank_resize.GROWS_IN_PLACE_WORD == _rank.GROWS_IN_PLACE_WORD
    assert rank_resize.SHRINKS_IN_PLACE_WORD == _rank.SHRINKS_IN_PLACE_WORD
    monkeypatch.setenv(_rank.RANK_MARKER_TOKEN_ENV, "t1")
    # hvd.elastic.run: both; the Trainer with commits in memory: shrinks
    # only; without: neither.
    for grows, shrinks, said in ((True, None, (True, True)),
                                 (False, True, (False, True)),
                                 (False, None, (False, False))):
        monkeypatch.setitem(rank_resize._state, "announced", False)
        rank_resize.announce(1, grows_in_place=grows,
                             shrinks_in_place=shrinks)
        line = capfdbinary.readouterr().err
        findings = job.Findings()
        relay = job._Relay(io.BytesIO(), None, None, findings)
        monkeypatch.setattr(relay, "_pieces", lambda: iter([line]))
        relay.run()
        assert (findings.resizable, findings.grows_in_place,
                findings.shrinks_in_place) == (True, *said), line


def _shrink_watcher(monkeypatch, tmp_path, listed, np_, hosts):
    """A Watcher of a job of np_ ranks on `hosts` under --recover-in-place,
    the launcher's own request writer (grow.writer), `listed` listed."""
    class Config:
        recover_in_place = True

    monkeypatch.setenv(_rank.ELASTIC_DIR_ENV, str(tmp_path))
    out = io.BytesIO()
    w = resize.Watcher(lambda: listed, lambda c: (list(c), []), np_, hosts,
                       1, np_, 1.0, job.Log(out, out), started=0.0,
                       clock=lambda: 0.0,
                       grow=grow.writer(Config(), ["cmd"]))
    return w, out, os.path.join(str(tmp_path), grow.REQUEST_NAME)


def test_watcher_shrinks_in_place_and_goes_on_at_the_new_size(
        monkeypatch, tmp_path):
    # 3 ranks on localhost, 2 slots listed: the request names rank 2 (the
    # highest) as leaving, then the signal; the attempt goes on at 2.
    w, out, path = _shrink_watcher(monkeypatch, tmp_path,
                                   [("localhost", 2)], 3, [("localhost", 3)])
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, True)
    assert proc.signals == [signal.SIGUSR1]
    with open(path) as f:
        assert json.load(f) == {
            "old_np": 3, "new_np": 2, "leave": [2],
            "why": "host localhost has 2 slot(s) now, not 3"}
    assert out.getvalue() == (
        b"kerasdist: shrinking from 3 to 2 ranks: host localhost has 2 "
        b"slot(s) now, not 3; in place, at the ranks' next commit\n")
    assert (w.np, w.hosts, w.requested) == (2, [("localhost", 2)], None)


def test_watcher_shrinks_in_place_keeping_the_jobs_host_order(monkeypatch,
                                                             tmp_path):
    # Host a left; b listed first: the ranks on b (2, 3) stay, renumbered
    # 0 and 1, on b then c, the job's order.
    w, out, path = _shrink_watcher(
        monkeypatch, tmp_path, [("c", 1), ("b", 2)], 4,
        [("a", 1), ("b", 2), ("c", 1)])
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, True)
    with open(path) as f:
        assert json.load(f)["leave"] == [0]
    assert (w.np, w.hosts) == (3, [("b", 2), ("c", 1)])


def test_watcher_shrinks_by_relaunching_where_the_ranks_do_not_grow_in_place(
        monkeypatch, tmp_path):
    # The Trainer's ranks announce no grows=in-place: no request; the
    # ranks are asked to stop for a relaunch at 2.
    w, out, path = _shrink_watcher(monkeypatch, tmp_path,
                                   [("localhost", 2)], 3, [("localhost", 3)])
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, False)
    assert proc.signals == [signal.SIGUSR1] and not os.path.exists(path)
    assert w.requested.new_np == 2


def test_watcher_shrinks_in_place_where_the_ranks_shrink_but_grow_by_relaunch(
        monkeypatch, tmp_path):
    # The Trainer with commits in memory announces shrinks=in-place but
    # no grows=in-place: a shrink is asked in place, a grow by a relaunch.
    w, out, path = _shrink_watcher(monkeypatch, tmp_path,
                                   [("localhost", 2)], 3, [("localhost", 3)])
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, False, True)
    assert proc.signals == [signal.SIGUSR1] and os.path.exists(path)
    assert (w.np, w.requested) == (2, None)
    w, out, path = _grow_watcher(tmp_path, [("localhost", 3)])
    w.poll()
    w.step(1.0, True, proc, False, True)
    assert not os.path.exists(path) and w.requested.new_np == 3


def test_watcher_relaunches_a_shrink_that_lists_a_new_host(monkeypatch,
                                                          tmp_path):
    # a:2 left, b:1 listed in its place next to c:1: 2 ranks, but only
    # one of the job's would stay; a relaunch, said in one line.
    w, out, path = _shrink_watcher(monkeypatch, tmp_path,
                                   [("b", 1), ("c", 1)], 3,
                                   [("a", 2), ("c", 1)])
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, True)
    assert proc.signals == [signal.SIGUSR1] and not os.path.exists(path)
    assert w.requested.new_np == 2
    assert out.getvalue().startswith(
        b"kerasdist: cannot shrink in place (the ranks that stay would not "
        b"fill the hosts listed: a host the job does not run on is "
        b"listed); relaunching instead.\n")


def test_grow_leavers_are_each_hosts_highest_ranks_beyond_its_slots():
    # mpirun placed 5 ranks on a:2, b:3 as a, a, b, b, b.
    assert grow.leavers([("a", 2), ("b", 3)], [("a", 2), ("b", 1)], 5,
                        3) == [3, 4]
    assert grow.leavers([("a", 2), ("b", 3)], [("a", 1), ("b", 3)], 5,
                        4) == [1]
    # A host no longer listed: all its ranks.
    assert grow.leavers([("a", 2), ("b", 3)], [("b", 3)], 5, 3) == [0, 1]
    # A host listed that the job does not run on: not in place.
    assert grow.leavers([("a", 2), ("b", 3)], [("a", 2), ("c", 1)], 5,
                        3) is None
    # Slots the job did not use (-np below the hosts' slots).
    assert grow.leavers([("a", 4)], [("a", 2)], 3, 2) == [2]


def test_shrink_request_is_known_by_the_ranks_that_leave():
    from kerasdist._core import shrink as rank_shrink

    change = resize.Change(3, 2, [("a", 2)], "host a has 2 slot(s) now")
    body = grow.shrink_request(change, [("a", 3)])
    assert body["leave"] == [2] and rank_shrink.is_request(body)
    assert not rank_shrink.is_request(grow.request(
        resize.Change(2, 3, [("a", 3)], "why"), [("a", 2)], ["cmd"]))
    assert not rank_shrink.is_request(None)


def test_grow_writer_only_with_recovery_in_place_on_this_machine(
        monkeypatch, tmp_path):
    class Config:
        recover_in_place = False

    monkeypatch.setenv(_rank.ELASTIC_DIR_ENV, str(tmp_path))
    assert grow.writer(Config(), ["cmd"]) is None
    Config.recover_in_place = True
    write = grow.writer(Config(), ["cmd"])
    path = tmp_path / grow.REQUEST_NAME
    assert write(resize.Change(1, 2, [("localhost", 2)], "why"),
                 [("localhost", 1)]) is None
    with open(path) as f:
        assert [r["info"] for r in json.load(f)["ranks"]] == [
            ["host=localhost"]]


def test_grow_why_not_a_new_host_nor_another_hosts_daemons():
    def local(host):
        return host == "me"

    # Open MPI 5.0 cannot add a host to the job, and its daemons on other
    # hosts fail on MPI_Comm_spawn.
    assert grow.why_not(resize.Change(1, 2, [("me", 1), ("b", 1)], "b"),
                        [("me", 1)], local).startswith(
        "Open MPI 5.0's mpirun cannot start ranks on a host it did not "
        "start the job on (b)")
    assert grow.why_not(resize.Change(2, 3, [("me", 1), ("b", 2)], "b"),
                        [("me", 1), ("b", 1)], local) == (
        "Open MPI 5.0's daemons on other hosts than this one (b) fail on "
        "MPI_Comm_spawn (open-mpi/ompi#13521)")
    assert grow.why_not(resize.Change(1, 2, [("me", 2)], "me"), [("me", 1)],
                        local) is None


def test_watcher_relaunches_when_it_cannot_grow_in_place(tmp_path):
    out = io.BytesIO()
    w = resize.Watcher(lambda: [("a", 1), ("b", 1)], lambda c: (list(c), []),
                       1, [("a", 1)], 1, 2, 1.0, job.Log(out, out),
                       started=0.0, clock=lambda: 0.0,
                       grow=lambda change, hosts: "a new host")
    proc = _Proc()
    w.poll()
    w.step(1.0, True, proc, True)
    assert proc.signals == [signal.SIGUSR1] and w.requested.new_np == 2
    assert out.getvalue() == (
        b"kerasdist: cannot grow in place (a new host); relaunching "
        b"instead.\nkerasdist: growing from 1 to 2 ranks: host b joined\n")


def test_trusted_request_file_is_the_launchers_only(tmp_path):
    # A grow request names commands to run: rank 0 takes only a regular
    # file of its user's that no other user can write, as the launcher
    # writes it.
    grow.write_request(str(tmp_path), {"old_np": 2})
    path = str(tmp_path / grow.REQUEST_NAME)
    assert rank_grow.trusted_request_file(path) is None
    os.chmod(path, 0o666)
    assert "other users can write it (mode 666)" in \
        rank_grow.trusted_request_file(path)
    os.chmod(path, 0o600)
    link = str(tmp_path / "link.json")
    os.symlink(path, link)
    assert rank_grow.trusted_request_file(link) == "it is not a regular file"
    if os.getuid() == 0:  # only root can give a file away
        os.chown(path, 12345, -1)
        assert rank_grow.trusted_request_file(path).startswith(
            "it belongs to user 12345")
