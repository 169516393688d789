"""Unit tests of the launcher's pure parts: no processes, no MPI."""

import dataclasses
import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.rendezvous import environment  # noqa: E402
from kerasdist.run import _rank  # noqa: E402
from kerasdist.run import attempt_loop  # noqa: E402
from kerasdist.run import elastic  # noqa: E402
from kerasdist.run import hosts  # noqa: E402
from kerasdist.run import job  # noqa: E402
from kerasdist.run import launch  # noqa: E402
from kerasdist.run import launch_config  # noqa: E402
from kerasdist.run import mpi_command  # noqa: E402
from kerasdist.run import resize  # noqa: E402
from kerasdist.run import settings  # noqa: E402
from kerasdist.run import slurm  # noqa: E402
from kerasdist.tools import cli  # noqa: E402
from tests.support.helpers import rank_lines  # noqa: E402

# --- hosts -----------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("a:2,b:2", [("a", 2), ("b", 2)]),
    ("a", [("a", 1)]),
    ("a:1,b,a:3", [("a", 4), ("b", 1)]),
    ("node-1.example.org:8", [("node-1.example.org", 8)]),
    ("10.0.0.1:2", [("10.0.0.1", 2)]),
])
def test_parse_host_list(text, expected):
    assert hosts.parse_host_list(text) == expected


@pytest.mark.parametrize("text", [
    "", ",", "a:", "a:0", "a:-1", "a:x", "a:2,,b", ":2", "a:2:3", "a b:2",
])
def test_parse_host_list_rejects(text):
    with pytest.raises(ValueError, match="-H"):
        hosts.parse_host_list(text)


def test_parse_hostfile_text_formats():
    text = """
# a comment
node1 slots=2
node2:3   # trailing comment

node3
node4 slots=1 max_slots=4
node1 slots=1
"""
    assert hosts.parse_hostfile_text(text) == [
        ("node1", 3), ("node2", 3), ("node3", 1), ("node4", 1)]


@pytest.mark.parametrize("text, where", [
    ("node1 slots=0\n", "hf:1"),
    ("# c\nnode1 cpus=2\n", "hf:2"),
    ("node1 slots=two\n", "hf:1"),
    ("node1:x\n", "hf:1"),
])
def test_parse_hostfile_text_names_bad_line(text, where):
    with pytest.raises(ValueError, match=where):
        hosts.parse_hostfile_text(text, "hf")


def test_parse_hostfile_text_empty():
    with pytest.raises(ValueError, match="no hosts"):
        hosts.parse_hostfile_text("# nothing\n\n", "hf")


def test_parse_hostfile_missing(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        hosts.parse_hostfile(str(tmp_path / "missing"))


def test_parse_hostfile_reads_file(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb:2\n")
    assert hosts.parse_hostfile(str(path)) == [("a", 2), ("b", 2)]


def test_slots_and_hydra_arg():
    h = [("a", 2), ("b", 3)]
    assert hosts.total_slots(h) == 5
    assert hosts.hydra_hosts_arg(h) == "a:2,b:3"


# --- env -------------------------------------------------------------------

@pytest.mark.parametrize("value,expected", [
    (None, "glibc.malloc.hugetlb=1"),
    ("", "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2",
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),
    ("a=1:glibc.malloc.hugetlb=2", "a=1:glibc.malloc.hugetlb=2"),
    ("glibc.malloc.hugetlbx=1",
     "glibc.malloc.hugetlbx=1:glibc.malloc.hugetlb=1"),
])
def test_with_huge_pages_keeps_the_users_tunables(value, expected):
    assert _rank.with_huge_pages(value) == expected


def test_wrapper_argv_asks_for_huge_pages_only_when_told():
    assert "--huge-pages" in mpi_command.rank_wrapper_argv(huge_pages=True)
    assert "--huge-pages" not in mpi_command.rank_wrapper_argv()
    args = launch_config.parse_args(["--no-huge-pages", "-np", "2", "python",
                                     "x.py"])
    assert args.no_huge_pages
    assert not launch_config.parse_args(["-np", "2", "python",
                                         "x.py"]).no_huge_pages


def test_build_env_minimal():
    assert settings.build_env(0) == {"KERASDIST_RESTART_ATTEMPT": "0"}


def test_build_env_all(tmp_path):
    env = settings.build_env(
        2, fusion_threshold_mb=32, cycle_time_ms=3.5,
        timeline_filename="t.json", autotune=True, cwd=str(tmp_path))
    assert env == {
        "KERASDIST_FUSION_THRESHOLD": str(32 * 1048576),
        "KERASDIST_CYCLE_TIME": "3.5",
        "KERASDIST_TIMELINE": str(tmp_path / "t.json"),
        "KERASDIST_AUTOTUNE": "1",
        "KERASDIST_RESTART_ATTEMPT": "2",
    }


def test_build_env_fractions_and_zero():
    env = settings.build_env(0, fusion_threshold_mb=0.5, cycle_time_ms=0)
    assert env["KERASDIST_FUSION_THRESHOLD"] == "524288"
    assert env["KERASDIST_CYCLE_TIME"] == "0.0"
    env = settings.build_env(0, fusion_threshold_mb=0)
    assert env["KERASDIST_FUSION_THRESHOLD"] == "0"


def test_build_env_timeline_is_absolute():
    env = settings.build_env(0, timeline_filename="tl.json")
    assert os.path.isabs(env["KERASDIST_TIMELINE"])
    assert env["KERASDIST_TIMELINE"] == os.path.abspath("tl.json")


# --- arguments -------------------------------------------------------------

def test_parse_args_basic():
    args = launch_config.parse_args(["-np", "2", "python", "x.py",
                                     "--verbose"])
    assert args.np == 2
    assert args.command == ("python", "x.py", "--verbose")
    assert not args.verbose
    assert args.hosts is None
    assert args.max_restarts == 0


def test_parse_args_ends_in_a_frozen_launch_config():
    config = launch_config.parse_args(["-np", "2", "-H", "a:2", "--ssh-command",
                                       "ssh -p 2", "cmd", "x"])
    assert isinstance(config, launch_config.LaunchConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.np = 3
    # Nothing in it changes afterwards: every field is immutable.
    hash(config)
    assert dataclasses.replace(config) == config
    assert (config.command, config.hosts, config.ssh_argv) == (
        ("cmd", "x"), (("a", 2),), ("ssh", "-p", "2"))


def test_parse_args_all_flags():
    args = launch_config.parse_args([
        "-np", "4", "-H", "a:2,b:2", "--fusion-threshold-mb", "8",
        "--cycle-time-ms", "2.5", "--timeline-filename", "t.json",
        "--autotune", "--max-restarts", "3", "--timeout", "10",
        "--no-prefix", "--verbose", "--", "cmd", "-x"])
    assert args.hosts == (("a", 2), ("b", 2))
    assert args.fusion_threshold_mb == 8.0
    assert args.cycle_time_ms == 2.5
    assert args.autotune and args.no_prefix and args.verbose
    assert args.max_restarts == 3 and args.timeout == 10.0
    assert args.command == ("cmd", "-x")


def test_parse_args_np_written_together():
    for flag in ("-np2", "-n2", "-np=2"):
        assert launch_config.parse_args([flag, "cmd"]).np == 2, flag
    with pytest.raises(launch_config.UsageError, match="got 'px'"):
        launch_config.parse_args(["-npx", "cmd"])


def test_parse_args_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\n")
    args = launch_config.parse_args(["-np", "2", "--hostfile", str(path),
                                     "cmd"])
    assert args.hosts == (("a", 2),)


@pytest.mark.parametrize("argv, message", [
    (["-np", "0", "cmd"], "positive integer"),
    (["-np", "-1", "cmd"], "positive integer"),
    (["-np", "1.5", "cmd"], "positive integer"),
    (["-np", "two", "cmd"], "positive integer"),
    (["-np", "2"], "no command"),
    (["-np", "2", "--"], "no command"),
    (["cmd"], "required"),
    (["-np", "2", "-H", "a:x", "cmd"], "slots"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "cmd"], "cannot read"),
    (["-np", "5", "-H", "a:2,b:2", "cmd"], "more than the 4 slot"),
    (["-np", "2", "-H", "a:2", "--hostfile", "f", "cmd"], "not allowed"),
    (["-np", "2", "--timeout", "0", "cmd"], "positive number"),
    (["-np", "2", "--max-restarts", "-1", "cmd"], "non-negative"),
    (["-np", "2", "--fusion-threshold-mb", "x", "cmd"], "non-negative"),
    (["-np", "2", "--cycle-time-ms", "-3", "cmd"], "non-negative"),
    (["-np", "2", "--cycle-time-ms", "1e12", "cmd"],
     "'1e12' is above 60000, the most milliseconds a cycle may last"),
    (["-np", "2", "--fusion-threshold-mb", "1e308", "cmd"],
     "'1e308' is above 65536, the most MiB a fusion buffer may have"),
    (["-np", "2", "--min-np", "3", "cmd"], "--min-np 3 is more than -np 2"),
    (["-np", "2", "--min-np", "0", "cmd"], "positive integer"),
    (["-np", "2", "-H", "a:2", "--host-discovery-script", "/bin/true",
      "cmd"], "leave out -H"),
    (["-np", "2", "--host-discovery-script", "/nonexistent/discover",
      "cmd"], "not an executable file"),
])
def test_parse_args_rejects(argv, message):
    with pytest.raises(launch_config.UsageError, match=message):
        launch_config.parse_args(argv)


_TYPO = "100000000000000000000"


@pytest.mark.parametrize("argv, message", [
    (["-np", _TYPO, "cmd"], "argument -np/-n/--num-proc: " + _TYPO +
     " is above 1048576, the most ranks of a kerasdist job"),
    (["-np", "5000", "cmd"], "-np 5000 is above 4096, the most ranks "
     "kerasdist runs on one host, and no hosts are given: give the hosts"),
    (["-np", "2", "-H", "a:" + _TYPO, "cmd"],
     "slots is above 4096, the most ranks kerasdist runs on one host"),
    (["-np", "2", "-H", "a:4000,a:4000", "cmd"],
     "host a: 8000 slots is above 4096"),
    (["-np", "2", "--min-np", _TYPO, "cmd"], "argument --min-np: " + _TYPO +
     " is above 1048576"),
    (["-np", "2", "--max-restarts", _TYPO, "cmd"],
     "is above 1000000, the most restarts of a job"),
    (["-np", "2", "--timeout", "1e300", "cmd"], "is above 1e\\+09"),
    (["-np", "2", "--hostfile", "/dev/zero", "cmd"],
     "'/dev/zero' is longer than 16 MiB, the most a hostfile may have"),
])
def test_parse_args_bounds_every_number(argv, message, monkeypatch):
    # Numbers a real cluster never reaches but a typo does: one line,
    # before anything is sized by them (docs/launcher.md, "Bounds").
    monkeypatch.setattr(hosts, "MAX_RANKS_PER_HOST", 4096)
    with pytest.raises(launch_config.UsageError, match=message) as e:
        launch_config.parse_args(argv, environ={})
    assert "\n" not in str(e.value)


def test_the_launchers_bound_is_the_ranks():
    assert hosts.MAX_RANKS == environment.MAX_PROCESSES


def test_parse_args_bounds_the_slots_of_many_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("".join(f"h{i} slots=4000\n" for i in range(300)))
    with pytest.raises(launch_config.UsageError,
                       match="-np 1200000 .* is above 1048576"):
        launch_config.parse_args(["cmd"],
                                 environ={"HYDRA_HOST_FILE": str(path)})


@pytest.mark.parametrize("env, message", [
    ({"SLURM_JOB_NODELIST": "n[1-100000000000]"},
     "lists more than 1048576 entries"),
    ({"SLURM_JOB_NODELIST": "a[1-2000]b[1-2000]"},
     "lists more than 1048576 entries"),
    ({"SLURM_JOB_NODELIST": "n[1-2]",
      "SLURM_TASKS_PER_NODE": "2(x100000000000000000000)"},
     "gives more than 1048576 nodes"),
    ({"SLURM_JOB_NODELIST": "n[1-2]",
      "SLURM_TASKS_PER_NODE": _TYPO + "(x2)"}, "slots is above"),
])
def test_slurm_variables_are_bounded(env, message):
    with pytest.raises(ValueError, match=message):
        slurm.allocation({"SLURM_JOB_ID": "1", **env})


def test_discovery_output_is_bounded(tmp_path):
    script = tmp_path / "discover"
    script.write_text("#!/bin/sh\nyes localhost:1\n")
    script.chmod(0o755)
    with pytest.raises(ValueError, match="printed more than 16 MiB"):
        elastic.discover(str(script))


def test_unreported_ranks_are_never_listed_whole():
    findings = job.Findings()
    findings.add_exit("0")
    assert findings.unreported(int(_TYPO)) == (
        [1, 2, 3, 4, 5, 6, 7, 8], int(_TYPO) - 1)
    assert findings.unreported(1) == ([], 0)


def test_main_usage_error_is_one_line_exit_2(capfdbinary):
    assert launch.main(["-np", "0", "cmd"]) == 2
    err = capfdbinary.readouterr().err.decode()
    assert err.startswith("kerasdist run: error: ")
    assert err.count("\n") == 1


# --- mpiexec discovery and argv -------------------------------------------

def _fake_mpiexec(root):
    path = root / "bin" / "mpiexec"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_find_mpiexec_order(tmp_path):
    home = _fake_mpiexec(tmp_path / "home")
    prefix = _fake_mpiexec(tmp_path / "prefix")
    never = lambda *a, **k: None  # noqa: E731
    env = {"KERASDIST_MPI_HOME": str(tmp_path / "home")}
    assert mpi_command.find_mpiexec(env, str(tmp_path / "prefix"),
                                    never) == home
    assert mpi_command.find_mpiexec({}, str(tmp_path / "prefix"),
                                    never) == prefix
    found = mpi_command.find_mpiexec({}, str(tmp_path / "none"),
                                     lambda *a, **k: "/x/mpiexec")
    assert found == "/x/mpiexec"


def test_find_mpiexec_errors(tmp_path):
    never = lambda *a, **k: None  # noqa: E731
    with pytest.raises(FileNotFoundError, match="no mpiexec found"):
        mpi_command.find_mpiexec({}, str(tmp_path), never)
    with pytest.raises(FileNotFoundError, match="KERASDIST_MPI_HOME"):
        mpi_command.find_mpiexec({"KERASDIST_MPI_HOME": str(tmp_path)},
                                 str(tmp_path), never)


def test_build_mpiexec_argv():
    env = {"KERASDIST_AUTOTUNE": "1", "KERASDIST_RESTART_ATTEMPT": "0"}
    argv = mpi_command.build_mpiexec_argv(
        "/m/mpiexec", 4, ["python", "t.py"], env, hosts=[("a", 2), ("b", 2)],
        python="/py")
    wrapper = argv[argv.index("/py") + 3]
    assert argv == [
        "/m/mpiexec", "-genvall",
        "-genv", "KERASDIST_AUTOTUNE", "1",
        "-genv", "KERASDIST_RESTART_ATTEMPT", "0",
        "-hosts", "a:2,b:2", "-n", "4",
        "/py", "-I", "-S", wrapper, "--", "python", "t.py"]
    assert wrapper.endswith(os.path.join("kerasdist", "run", "_rank.py"))
    assert os.path.isfile(wrapper)


def test_build_mpiexec_argv_local_no_prefix():
    argv = mpi_command.build_mpiexec_argv("mpiexec", 2, ["c"], {},
                                          python="/py")
    assert "-hosts" not in argv
    assert argv[-2:] == ["--", "c"] and "--no-prefix" not in argv
    argv = mpi_command.build_mpiexec_argv("mpiexec", 2, ["c"], {},
                                          no_prefix=True, python="/py")
    assert argv[-3:] == ["--no-prefix", "--", "c"]


def test_build_mpiexec_argv_bind():
    argv = mpi_command.build_mpiexec_argv("mpiexec", 2, ["c"], {},
                                          python="/py", bind=True,
                                          report_bind=True)
    assert argv[-4:] == ["--bind", "--report-bind", "--", "c"]
    assert launch_config.parse_args(["-np", "2", "c"]).bind_to == "core"
    assert launch_config.parse_args(["-np", "2", "--bind-to", "none", "c"]
                                    ).bind_to == "none"
    with pytest.raises(launch_config.UsageError, match="bind-to"):
        launch_config.parse_args(["-np", "2", "--bind-to", "socket", "c"])


# --- CPU binding -------------------------------------------------------------

def _shares(cpus, ranks, core_of):
    return [_rank.cpu_share(cpus, r, ranks, core_of) for r in range(ranks)]


def test_cpu_share_splits_cores_evenly_and_disjointly():
    one_thread = lambda cpu: ("0", str(cpu))  # noqa: E731
    assert _shares(range(2), 2, one_thread) == [{0}, {1}]
    assert _shares(range(8), 3, one_thread) == [{0, 1, 2}, {3, 4, 5}, {6, 7}]
    assert _shares(range(4), 1, one_thread) == [{0, 1, 2, 3}]
    # Only the CPUs this process may use (e.g. under taskset), in order.
    assert _shares({5, 3, 9, 7}, 2, one_thread) == [{3, 5}, {7, 9}]
    # More ranks than CPUs: nobody is bound.
    assert _shares(range(2), 3, one_thread) == [None, None, None]


def test_cpu_share_keeps_hardware_threads_of_a_core_together():
    # Linux numbers the second thread of core c as c + 4 here (4 cores x 2).
    smt = lambda cpu: ("0", str(cpu % 4))  # noqa: E731
    assert _shares(range(8), 2, smt) == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert _shares(range(8), 4, smt) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    # More ranks than cores but not than threads: threads are split instead.
    assert _shares(range(8), 8, smt) == [{c} for c in range(8)]
    # Two sockets with the same core ids are different cores.
    sockets = lambda cpu: (str(cpu // 2), "0")  # noqa: E731
    assert _shares(range(4), 2, sockets) == [{0, 1}, {2, 3}]


def test_local_rank_from_env():
    assert _rank.local_rank_from_env(
        {"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}) == (1, 2)
    assert _rank.local_rank_from_env(
        {"OMPI_COMM_WORLD_LOCAL_RANK": "0",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == (0, 4)
    assert _rank.local_rank_from_env({}) is None
    assert _rank.local_rank_from_env(
        {"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}) is None


# --- wrapper markers and status text ---------------------------------------

def test_marker_round_trip():
    line = _rank.format_marker("3", "my host", -9)
    assert line.endswith(b"\n")
    assert _rank.parse_marker(b"partial output" + line) == ("3", "my_host", -9)
    assert _rank.parse_marker(b"[0]<stderr>:ordinary line\n") is None
    # With the launcher's token, only a marker that carries it counts: a
    # rank that prints a marker (a log, a nested job) stops nothing.
    signed = _rank.format_marker("3", "h", 1, token="t0k")
    assert _rank.parse_marker(signed, "t0k") == ("3", "h", 1)
    assert _rank.parse_marker(line, "t0k") is None
    assert _rank.parse_marker(_rank.format_marker("3", "h", 1, "bad"),
                              "t0k") is None



@pytest.mark.parametrize("started,code", [((0, 1), 0), ((1,), 1)])
def test_a_rank_that_never_reports_fails_the_attempt(capfdbinary, started,
                                                      code):
    # A stand-in for mpiexec that exits 0 having run the real wrapper for
    # some of the 2 ranks only: hydra does that when a rank exits without
    # MPI finalize (it kills the others, and may exit 0).
    wrapper = os.path.join(os.path.dirname(_rank.__file__), "_rank.py")
    runs = "; ".join(f"PMI_RANK={r} {sys.executable} -I -S {wrapper} -- true"
                     for r in started)
    with job.Interrupts() as interrupts:
        outcome = job.run_attempt(["sh", "-c", runs], dict(os.environ),
                                  interrupts, ranks=2)
    assert outcome.exit_code == code
    err = capfdbinary.readouterr().err.decode()
    if code:
        assert err.splitlines() == [
            "kerasdist: mpiexec exited with code 0, but rank 0 never reported "
            "an exit: mpiexec stopped it, as it does when a rank exits without "
            "MPI finalize (rank 1 exited with code 0)."], err
    else:
        assert err == ""

def test_under_recovery_in_place_a_rank_never_reported_was_lost(
        capfdbinary):
    # --recover-in-place: rank 1's host (or link) went with its exit
    # marker; rank 0 finished and the manager exited 0: the survivors'
    # success, said in one line. With no rank finished it is a failure.
    wrapper = os.path.join(os.path.dirname(_rank.__file__), "_rank.py")
    run0 = f"PMI_RANK=0 {sys.executable} -I -S {wrapper} -- true"
    with job.Interrupts() as interrupts:
        outcome = job.run_attempt(["sh", "-c", run0], dict(os.environ),
                                  interrupts, ranks=2, keep_survivors=True)
        assert outcome.exit_code == 0
        assert capfdbinary.readouterr().err.decode().splitlines() == [
            "kerasdist: rank 1 never reported an exit (lost with its host "
            "or its link); rank 0 finished without it (recovery in "
            "place)."]
        outcome = job.run_attempt(["true"], dict(os.environ), interrupts,
                                  ranks=2, keep_survivors=True)
    assert outcome.exit_code == 1


def test_rank_from_env():
    assert _rank.rank_from_env({"PMI_RANK": "2"}) == "2"
    assert _rank.rank_from_env({"OMPI_COMM_WORLD_RANK": "1"}) == "1"
    assert _rank.rank_from_env({}) == "?"


def test_describe_status():
    assert job.describe_status(3) == "code 3"
    assert job.describe_status(-signal.SIGKILL) == "signal 9 (SIGKILL)"
    assert job.status_exit_code(-9) == 137
    assert job.status_exit_code(3) == 3
    failure = job.RankFailure("1", "x", -9)
    assert failure.describe() == \
        "rank 1 (host x) exited with signal 9 (SIGKILL)"
    assert failure.describe(with_host=False) == \
        "rank 1 exited with signal 9 (SIGKILL)"


def test_rank_lines():
    out = ("[0]<stdout>:a\n[1]<stdout>:b\n[1]<stderr>:c\n"
           "kerasdist: x\n[1]<stdout>:d:e\n")
    assert rank_lines(out, 1) == ["b", "d:e"]
    assert rank_lines(out, 1, "stderr") == ["c"]
    assert rank_lines(out, 2) == []


# --- cli and import hygiene ------------------------------------------------

def test_cli_dispatch_is_lazy_and_listed(capsys):
    for target, _ in cli._COMMANDS.values():
        assert ":" in target
    assert cli.main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2


def test_launcher_imports_no_tensorflow():
    code = ("import sys; import kerasdist.tools.cli, kerasdist.run.launch, "
            "kerasdist.run.__main__; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'numpy', 'keras')]; "
            "assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                   timeout=60)


def test_min_np_defaults_to_np():
    assert launch_config.parse_args(["-np", "3", "cmd"]).min_np == 3
    assert launch_config.parse_args(["-np", "3", "--min-np", "1",
                                     "cmd"]).min_np == 1


def test_ranks_for_takes_what_fits_between_min_np_and_np():
    from kerasdist.run import elastic

    assert elastic.ranks_for(4, 2, [("a", 2), ("b", 2)]) == 4
    assert elastic.ranks_for(4, 2, [("a", 2), ("b", 1)]) == 3
    assert elastic.ranks_for(4, 2, [("a", 1)]) is None
    assert elastic.ranks_for(4, 1, []) is None
    assert elastic.ranks_for(2, 2, [("a", 8)]) == 2


def test_discover_reads_hostfile_lines_and_names_a_broken_script(tmp_path):
    from kerasdist.run import elastic

    good = tmp_path / "good.sh"
    good.write_text("#!/bin/sh\necho 'a:2'\necho 'b slots=3 # spare'\n")
    good.chmod(0o755)
    assert elastic.discover(str(good)) == [("a", 2), ("b", 3)]
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho 'no hosts today' >&2\nexit 4\n")
    bad.chmod(0o755)
    with pytest.raises(ValueError, match="exited with code 4: no hosts today"):
        elastic.discover(str(bad))
    empty = tmp_path / "empty.sh"
    empty.write_text("#!/bin/sh\ntrue\n")
    empty.chmod(0o755)
    with pytest.raises(ValueError, match="no hosts listed"):
        elastic.discover(str(empty))


# --- growing and shrinking (--host-discovery-script while the job runs) ----

def _discovery(tmp_path, text="a:1\n"):
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nprintf '{text}'\n")
    script.chmod(0o755)
    return str(script)


def test_max_np_and_discovery_interval_defaults(tmp_path):
    script = _discovery(tmp_path)
    args = launch_config.parse_args(["-np", "2", "--host-discovery-script",
                                     script, "cmd"])
    assert args.max_np == 2 and args.min_np == 2
    assert args.discovery_interval == resize.DEFAULT_INTERVAL_S == 5.0
    args = launch_config.parse_args(["-np", "2", "--host-discovery-script",
                                     script, "--max-np", "4", "--min-np", "1",
                                     "--discovery-interval", "0.5", "cmd"])
    assert (args.min_np, args.np, args.max_np) == (1, 2, 4)
    assert args.discovery_interval == 0.5
    assert launch_config.parse_args(["-np", "3", "cmd"]).max_np == 3


@pytest.mark.parametrize("extra, message", [
    (["--max-np", "1"], "--max-np 1 is less than -np 2"),
    (["--max-np", "0"], "positive integer"),
    (["--max-np", "x"], "positive integer"),
    (["--discovery-interval", "0"], "positive number"),
    (["--discovery-interval", "-1"], "non-negative number"),
    (["--discovery-interval", "inf"], "non-negative number"),
])
def test_resize_flags_reject_bad_values(tmp_path, extra, message):
    argv = ["-np", "2", "--host-discovery-script", _discovery(tmp_path),
            *extra, "cmd"]
    with pytest.raises(launch_config.UsageError, match=message):
        launch_config.parse_args(argv)


@pytest.mark.parametrize("flag, value", [("--max-np", "4"),
                                         ("--discovery-interval", "2")])
def test_resize_flags_need_a_discovery_script(flag, value):
    with pytest.raises(launch_config.UsageError,
                       match=f"{flag} needs --host-discovery-script"):
        launch_config.parse_args(["-np", "2", flag, value, "cmd"])
    with pytest.raises(launch_config.UsageError,
                       match=f"{flag} does not go with node mode"):
        launch_config.parse_args(["--nnodes", "1", flag, value, "cmd"])


def test_elastic_jobs_tell_their_ranks(tmp_path):
    args = launch_config.parse_args(["-np", "1", "--host-discovery-script",
                                     _discovery(tmp_path), "cmd"])
    assert attempt_loop.rank_env(args, 0)[_rank.ELASTIC_ENV] == "1"
    args = launch_config.parse_args(["-np", "1", "cmd"])
    assert _rank.ELASTIC_ENV not in attempt_loop.rank_env(args, 0)


@pytest.mark.parametrize("line, marker, seen", [
    (b"[0]<stderr>:\x1ekerasdist-progress token=t1\n", "PROGRESS", True),
    (b"\x1ekerasdist-resizable rank=3 token=t1\n", "RESIZABLE", True),
    (b"[0]<stderr>:\x1ekerasdist-progress\n", "PROGRESS", False),
    (b"[0]<stderr>:\x1ekerasdist-progress token=t2\n", "PROGRESS", False),
    (b"\x1ekerasdist-resizable rank=3\n", "RESIZABLE", False),
    (b"\x1ekerasdist-resizable rank=3 token=\n", "RESIZABLE", False),
    (b"[0]<stdout>:print \x1ekerasdist-progress token=t1x\n", "PROGRESS",
     False),
])
def test_rank_markers_count_with_the_jobs_token_only(line, marker, seen):
    marker = getattr(_rank, marker + "_MARKER")
    assert _rank.is_rank_marker(line, marker, "t1") is seen
    assert _rank.is_rank_marker(line, marker, None)


def test_rank_side_writes_the_jobs_token(capfdbinary, monkeypatch):
    from kerasdist._core import resize as _resize

    monkeypatch.setenv(_rank.MARKERS_READ_ENV, "1")
    monkeypatch.setenv(_rank.RANK_MARKER_TOKEN_ENV, "t1")
    monkeypatch.setitem(_resize._state, "announced", False)
    _resize.report_progress()
    _resize.announce(2)
    assert capfdbinary.readouterr().err == (
        b"\x1ekerasdist-progress token=t1\n"
        b"\x1ekerasdist-resizable rank=2 token=t1\n")


def test_rank_side_names_are_the_launchers():
    from kerasdist._core import resize as _resize

    assert _resize.ELASTIC_ENV == _rank.ELASTIC_ENV == "KERASDIST_ELASTIC"
    assert _resize.RESIZE_EXIT_CODE == _rank.RESIZE_EXIT_CODE
    assert _resize.RESIZABLE_MARKER == _rank.RESIZABLE_MARKER
    assert _resize.PROGRESS_MARKER == _rank.PROGRESS_MARKER
    assert _resize.MARKERS_READ_ENV == _rank.MARKERS_READ_ENV
    assert _resize.RANK_MARKER_TOKEN_ENV == _rank.RANK_MARKER_TOKEN_ENV
    from kerasdist import elastic
    assert elastic.ELASTIC_DIR_ENV == _rank.ELASTIC_DIR_ENV == \
        "KERASDIST_ELASTIC_DIR"
    from kerasdist.rendezvous import protocol
    assert _rank.PEER_LOST_EXIT_CODE == protocol.EXIT_PEER_LOST
    # Not the heartbeat's code (a lost peer), nor a signal's (128+N).
    assert _rank.RESIZE_EXIT_CODE not in (0, 1, 2, 75, 124)
    assert _rank.RESIZE_EXIT_CODE < 128


def test_growth_is_bounded_by_max_np():
    grow = resize.decide(1, [("a", 1)], [("a", 1), ("b", 1), ("c", 1)],
                         min_np=1, max_np=2)
    assert (grow.old_np, grow.new_np) == (1, 2)
    assert grow.line == ("growing from 1 to 2 ranks: host b joined, "
                         "host c joined")
    more = resize.decide(1, [("a", 1)], [("a", 4)], min_np=1, max_np=3)
    assert more.new_np == 3
    assert more.line == ("growing from 1 to 3 ranks: host a has 4 slot(s) "
                         "now, not 1")
    # Already at --max-np: more hosts change nothing.
    assert resize.decide(2, [("a", 1), ("b", 1)],
                         [("a", 1), ("b", 1), ("c", 1)], 1, 2) is None
    assert resize.decide(2, [("a", 1), ("b", 1)], [("a", 1), ("b", 1)],
                         1, 2) is None


def test_shrink_is_bounded_by_min_np():
    hosts = [("a", 1), ("b", 1), ("c", 1)]
    shrink = resize.decide(3, hosts, [("a", 1), ("c", 1)], 2, 3)
    assert shrink.new_np == 2 and shrink.hosts == [("a", 1), ("c", 1)]
    assert shrink.line == "shrinking from 3 to 2 ranks: host b left"
    assert resize.decide(3, hosts, [("a", 1)], 2, 3) == "too few"
    assert resize.decide(3, hosts, [], 2, 3) == "too few"
    # A host that leaves while another of as many slots joins: same size.
    assert resize.decide(3, hosts, [("a", 1), ("b", 1), ("d", 1)],
                         2, 3) is None


def _outcome(**kw):
    return job.Outcome(kw.pop("exit_code", 1), **kw)


def test_a_resize_is_not_counted_as_a_restart():
    attempts = attempt_loop.Attempts(max_restarts=1)
    assert attempts.start() == 0
    resized = _outcome(exit_code=_rank.RESIZE_EXIT_CODE, resized=True)
    assert not resized.retryable
    for _ in range(3):
        assert attempts.after(resized) == "resize"
        attempts.start()
    assert attempts.restarts == 0 and attempts.resizes == 3
    assert attempts.most == 5  # the one restart allowed is still there
    assert attempts.after(_outcome()) == "restart"
    attempts.start()
    assert attempts.after(_outcome()) is None  # --max-restarts 1 used up
    assert attempts.after(_outcome(exit_code=0)) is None
    assert attempts.started == 5
    # A failure that a relaunch would repeat, a timeout, Ctrl-C: no retry.
    for final in (_outcome(final=True), _outcome(timed_out=True),
                  _outcome(signum=signal.SIGINT)):
        assert attempt_loop.Attempts(3).after(final) is None


def test_an_error_that_repeats_is_not_restarted_again():
    said = (("1", 1, "TypeError: bad"),)
    attempts = attempt_loop.Attempts(max_restarts=5)
    # Killed or silent (error None): always restarted; a new error too.
    assert attempts.after(_outcome()) == "restart"
    assert attempts.after(_outcome()) == "restart"
    assert attempts.after(_outcome(error=said)) == "restart"
    other = (("1", 1, "ValueError: other"),)
    assert attempts.after(_outcome(error=other)) == "restart"
    assert attempts.repeated is None
    assert attempts.after(_outcome(error=other)) is None
    assert attempts.repeated == other and attempts.restarts == 4


def test_an_error_after_saved_progress_is_not_a_repeat():
    said = (("0", 1, "RuntimeError: lost"),)
    attempts = attempt_loop.Attempts(max_restarts=5)
    progressed = _outcome(error=said)
    progressed.progressed = True
    assert attempts.after(_outcome(error=said)) == "restart"
    assert attempts.after(progressed) == "restart"   # a checkpoint between
    assert attempts.after(_outcome(error=said)) == "restart"
    assert attempts.after(_outcome(error=said)) is None
    assert attempts.repeated == said


def test_findings_error_needs_every_culprits_last_line():
    findings = job.Findings()
    findings.add_failure(job.RankFailure("1", "h", 1))
    assert findings.error() is None           # rank 1 said nothing
    findings.last_error["1"] = "TypeError: bad"
    assert findings.error() == (("1", 1, "TypeError: bad"),)
    findings.add_failure(job.RankFailure("0", "h", 3))
    assert findings.error() is None           # rank 0 said nothing
    findings.last_error["0"] = "OSError: disk full"
    assert len(findings.error()) == 2
    findings.add_failure(job.RankFailure("2", "h", -9))
    findings.last_error["2"] = "WARNING: something"
    assert findings.error() is None           # rank 2 was killed


class _Proc:
    """Stands in for mpiexec: records the signals the watcher sends."""

    def __init__(self):
        self.signals = []

    def send_signal(self, signum):
        self.signals.append(signum)


def _watcher(listed, np_=1, hosts=(("a", 1),), answer=lambda h: True,
             announce_wait=10.0, **kw):
    import io

    out = io.BytesIO()
    state = {"listed": listed, "probed": []}

    def discover():
        if isinstance(state["listed"], Exception):
            raise state["listed"]
        return state["listed"]

    def answering(candidates):
        state["probed"].append(list(candidates))
        return ([c for c in candidates if answer(c[0])],
                [(c[0], "timed out") for c in candidates
                 if not answer(c[0])])

    w = resize.Watcher(discover, answering, np_, list(hosts),
                       kw.pop("min_np", 1), kw.pop("max_np", 2), 1.0,
                       job.Log(out, out), started=0.0,
                       announce_wait=announce_wait, clock=lambda: 0.0)
    return w, state, out


def test_watcher_asks_once_a_rank_checks_for_resizes():
    w, state, out = _watcher([("a", 1), ("b", 1)])
    proc = _Proc()
    w.poll()
    assert state["probed"] == [[("b", 1)]]  # only the host that joins
    w.step(1.0, False, proc)  # no rank said it checks yet: wait
    assert proc.signals == [] and out.getvalue() == b""
    w.step(2.0, True, proc)
    assert proc.signals == [signal.SIGUSR1]
    assert out.getvalue() == (b"kerasdist: growing from 1 to 2 ranks: host b "
                              b"joined\n")
    assert w.requested.new_np == 2 and w.requested.hosts == [("a", 1),
                                                             ("b", 1)]
    w.step(3.0, True, proc)
    assert proc.signals == [signal.SIGUSR1]  # asked once


def test_watcher_says_once_that_the_command_does_not_check():
    w, _, out = _watcher([("a", 1), ("b", 1)], announce_wait=10.0)
    proc = _Proc()
    w.poll()
    w.step(9.0, False, proc)
    assert out.getvalue() == b""
    for now in (10.0, 11.0, 12.0):
        w.step(now, False, proc)
    assert proc.signals == []
    assert out.getvalue() == (
        b"kerasdist: the hosts listed now would give 2 rank(s) (host b "
        b"joined), but the job's command does not check for resize requests "
        b"(kerasdist.Trainer with a checkpoint_dir does, and "
        b"hvd.elastic.run): it goes on at 1 rank(s).\n")


def test_watcher_grows_only_onto_hosts_that_answer():
    w, _, out = _watcher([("a", 1), ("b", 1)], answer=lambda h: h != "b")
    proc = _Proc()
    w.poll()
    w.poll()
    w.step(1.0, True, proc)
    assert proc.signals == [] and w.change is None
    assert out.getvalue() == (b"kerasdist: host b is listed but does not "
                              b"answer (timed out); not using it yet.\n")


def test_watcher_keeps_the_size_below_min_np_and_when_the_script_fails():
    w, state, out = _watcher([("a", 1)], np_=2, hosts=(("a", 1), ("b", 1)),
                             min_np=2)
    proc = _Proc()
    w.poll()
    w.poll()
    w.step(100.0, True, proc)
    assert proc.signals == []
    assert out.getvalue() == (
        b"kerasdist: the hosts listed now have 1 slot(s) (a:1), fewer than "
        b"--min-np 2; the job goes on at 2 rank(s).\n")
    out.truncate(0)
    out.seek(0)
    state["listed"] = ValueError("--host-discovery-script s exited with "
                                 "code 3")
    w.poll()
    w.poll()
    assert out.getvalue() == (b"kerasdist: --host-discovery-script s exited "
                              b"with code 3; the job goes on at 2 "
                              b"rank(s).\n")
    # Back at two hosts: nothing to do.
    state["listed"] = [("a", 1), ("b", 1)]
    w.poll()
    assert w.change is None


def test_watcher_forgets_a_change_that_went_back():
    w, state, _ = _watcher([("a", 1), ("b", 1)])
    w.poll()
    assert w.change is not None
    state["listed"] = [("a", 1)]
    w.poll()
    proc = _Proc()
    w.step(5.0, True, proc)
    assert w.change is None and proc.signals == []


def test_jobs_that_may_be_relaunched_get_an_elastic_dir(tmp_path,
                                                        monkeypatch):
    monkeypatch.delenv(_rank.ELASTIC_DIR_ENV, raising=False)
    for argv, wanted in ((["-np", "1", "cmd"], False),
                         (["-np", "1", "--max-restarts", "1", "cmd"], True),
                         (["-np", "1", "--host-discovery-script",
                           _discovery(tmp_path), "cmd"], True)):
        with launch._elastic_dir(launch_config.parse_args(argv)) as d:
            path = os.environ.get(_rank.ELASTIC_DIR_ENV)
            assert (path is not None) == wanted, argv
            assert path is None or os.path.isdir(path)
        assert _rank.ELASTIC_DIR_ENV not in os.environ
        assert path is None or not os.path.exists(path)
        assert d.path == path
    # One set already (storage every host sees) is kept.
    monkeypatch.setenv(_rank.ELASTIC_DIR_ENV, str(tmp_path))
    with launch._elastic_dir(launch_config.parse_args(
            ["-np", "1", "--max-restarts", "1", "cmd"])):
        assert os.environ[_rank.ELASTIC_DIR_ENV] == str(tmp_path)
    assert os.environ[_rank.ELASTIC_DIR_ENV] == str(tmp_path)
    assert tmp_path.is_dir()


def test_a_hosts_failures_arriving_apart_are_named_in_one_line():
    # A host's ranks killed together reach the launcher one by one through
    # the host's proxy; on a loaded machine 0.8 s apart. The launcher's
    # line must name both (it waits 1 s after the first failure and until
    # none came for 0.5 s), and a stream that never settles is cut at 3 s.
    class _Log:
        def __init__(self):
            self.lines = []

        def line(self, text):
            self.lines.append(text)

    def stopper():
        proc = subprocess.Popen([sys.executable, "-c",
                                 "import time; time.sleep(60)"],
                                start_new_session=True)
        findings, log = job.Findings(), _Log()
        return proc, findings, log, job._Stopper(
            proc, findings, job.Interrupts(), None, None, log)

    proc, findings, log, s = stopper()
    try:
        findings.add_failure(job.RankFailure("1", "kdt1", -9))
        for now in (0.0, 0.5):
            s.step(now)
        findings.add_failure(job.RankFailure("2", "kdt1", -9))
        for now in (0.8, 1.0, 1.2):
            s.step(now)
        assert log.lines == [] and s.reason is None
        s.step(1.35)
        assert log.lines == ["ranks 1, 2 (host kdt1) exited with signal 9 "
                             "(SIGKILL); stopping the other ranks."]
        assert proc.wait(timeout=30) == -15  # stopped with SIGTERM
    finally:
        proc.kill()
        proc.wait()

    proc, findings, log, s = stopper()
    try:
        for i in range(8):  # one every 0.4 s: never quiet for 0.5 s
            findings.add_failure(job.RankFailure(str(i), f"h{i}", 1))
            s.step(0.4 * i)
        assert s.reason is None and log.lines == []
        s.step(3.0)
        assert s.reason == "failure" and len(log.lines) == 1, log.lines
        assert log.lines[0].startswith("rank 0 (host h0) exited with code 1")
    finally:
        proc.kill()
        proc.wait()


def test_a_resize_request_after_the_program_ended_is_ignored():
    # An exit function registered before kd.init() installs the resize
    # handler runs after kerasdist's own (atexit runs them last in, first
    # out): by then SIGUSR1 is ignored, so a request that comes while the
    # interpreter shuts down (Python resets its handlers to the default
    # action, which ends the process) cannot kill a rank that finished.
    code = (
        "import atexit, os, signal\n"
        "def late():\n"
        "    print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "atexit.register(late)\n"
        "from kerasdist._core import resize as _resize\n"
        "assert _resize.install()\n")
    env = dict(os.environ, KERASDIST_ELASTIC="1")
    p = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, "True\n"), p


# --- MPICH's /dev/shm segments of a failed attempt ---------------------------

def test_orphan_shm_segments_of_an_attempt_are_removed(tmp_path):
    import mmap
    import time

    from kerasdist.run import shm
    since = time.time() - 1.0
    old = tmp_path / "mpich_shm_old_0"
    old.write_bytes(b"x" * 4096)
    os.utime(old, (since - 100, since - 100))  # an earlier job's: kept
    orphan = tmp_path / "mpich_shm_dead_0"
    orphan.write_bytes(b"x" * 4096)
    live = tmp_path / "mpich_shm_live_0"
    live.write_bytes(b"x" * 4096)
    other = tmp_path / "not_mpich"
    other.write_bytes(b"x")
    with open(live, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)  # a live rank maps it: kept
        try:
            assert shm.remove_orphans(since, str(tmp_path)) == [
                "mpich_shm_dead_0"]
        finally:
            mapping.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mpich_shm_live_0", "mpich_shm_old_0", "not_mpich"]
