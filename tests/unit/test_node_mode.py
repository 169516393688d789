"""Unit tests of node mode's pure parts: flag checks and rank variables."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.rendezvous import conventions  # noqa: E402
from kerasdist.run import _rank  # noqa: E402
from kerasdist.run import hosts  # noqa: E402
from kerasdist.run import launch_config  # noqa: E402
from kerasdist.run import node  # noqa: E402


def test_plan_defaults_are_torchruns():
    assert node.plan() == node.Plan(1, 0, 1, "127.0.0.1", None, 1)
    p = node.plan("2", "1", "4", "h0")
    assert p == node.Plan(2, 1, 4, "h0", 29500, 8)
    assert node.plan("2:2", "0", "1", "h0", "1234", np=2).master_port == 1234


@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes="2", node_rank="2", master_addr="h"),
     "--node-rank 2 is out of range for --nnodes 2; give each host its own "
     "number, 0 to 1."),
    (dict(nnodes="2", node_rank="-1", master_addr="h"),
     "--node-rank -1 is out of range"),
    (dict(nnodes="1", node_rank="x"), "--node-rank 'x' is not an integer"),
    (dict(nnodes="2", node_rank="1"),
     "--master-addr is required with --nnodes 2: give node 0's host name"),
    (dict(nnodes="2", master_addr=" "), "--master-addr is empty"),
    (dict(master_port="0"), "--master-port '0' is not a TCP port"),
    (dict(master_port="65536"), "--master-port '65536' is not a TCP port"),
    (dict(master_port="http"), "--master-port 'http' is not a TCP port"),
    (dict(nnodes="2", nproc_per_node="2", master_addr="h", np=3),
     "-np 3 does not match --nnodes 2 x --nproc-per-node 2 = 4 ranks; leave "
     "out -np in node mode."),
    (dict(nnodes="0"), "--nnodes '0' is not a positive integer"),
    (dict(nnodes="1:3"), "--nnodes 1:3: a range of nodes (growing or "
     "shrinking jobs) is not supported"),
    (dict(nproc_per_node="gpu"), "--nproc-per-node 'gpu' is not a positive"),
    (dict(nproc_per_node="1000000000"), "--nproc-per-node 1000000000 is "
     "above 4096, the most ranks kerasdist runs on one host; give the number"
     " of ranks to start on this host"),
    (dict(nnodes="100000000000000000000", master_addr="h"),
     "--nnodes 100000000000000000000 is above 1048576, the most hosts of a "
     "kerasdist job"),
    (dict(nnodes="1000", nproc_per_node="2000", master_addr="h"),
     "--nnodes 1000 x --nproc-per-node 2000 = 2000000 ranks is above "
     "1048576, the most ranks of a kerasdist job"),
])
def test_plan_rejects(kwargs, message, monkeypatch):
    monkeypatch.setattr(hosts, "MAX_RANKS_PER_HOST", 4096)
    with pytest.raises(ValueError) as e:
        node.plan(**kwargs)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_the_manager_makes_each_ranks_variables_from_the_plan():
    # The launcher hands the manager the plan, not 4096 sets of variables
    # (one argument holds at most 128 KiB).
    p = node.plan("2", "1", "4096", "h0", "29501")
    manager = node.Manager({"argv": ["true"], "plan": list(p),
                             "port": 29501})
    assert len(manager.ranks) == 4096
    assert manager.ranks[5] == node.rank_env(p, 5, 29501)
    assert manager.ranks[5]["RANK"] == "4101"


def test_rank_env_is_torchruns_convention():
    p = node.plan("2", "1", "2", "h0", "29501")
    envs = [node.rank_env(p, local) for local in range(2)]
    assert [e["RANK"] for e in envs] == ["2", "3"]
    assert node.ranks_of(p) == [2, 3]
    for local, env in enumerate(envs):
        launch_ = conventions.detect(env)
        assert launch_ == conventions.Launch("torchrun", 2 + local, 4, local,
                                             2, ("h0", 29501))
        assert env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert node.describe(p) == ("node 1 of 2: ranks 2-3 of 4, coordinator "
                                "h0:29501")


def test_parse_args_node_mode_and_torchrun_spellings():
    args = launch_config.parse_args(
        ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "2",
         "--master_addr", "h0", "--master_port", "29600", "python", "t.py"],
        environ={})
    assert args.node == node.Plan(2, 1, 2, "h0", 29600, 4)
    assert args.np == 4 and args.command == ("python", "t.py")
    # No node flag: the mpiexec path, as before.
    assert launch_config.parse_args(["-np", "2", "x"],
                                    environ={}).node is None


def test_parse_args_node_mode_ignores_slurm():
    environ = {"SLURM_JOB_NODELIST": "a", "SLURM_TASKS_PER_NODE": "1",
               "SLURM_NTASKS": "1", "SLURM_JOB_ID": "1"}
    args = launch_config.parse_args(["--nproc-per-node", "4", "x"],
                                    environ=environ)
    assert args.np == 4 and args.slurm is None


@pytest.mark.parametrize("flags, name", [
    (["-H", "a:2"], "-H"),
    (["--max-restarts", "1"], "--max-restarts"),
    (["--min-np", "1"], "--min-np"),
])
def test_parse_args_node_mode_rejects_mpiexec_flags(flags, name):
    with pytest.raises(launch_config.UsageError,
                       match=f"^{name} does not go with node mode"):
        launch_config.parse_args([*flags, "--nnodes", "1", "x"], environ={})


def test_parse_args_node_mode_checks_the_transport():
    ok = launch_config.parse_args(["--nnodes", "1", "--recover-in-place",
                                   "x"], environ={"KERASDIST_TRANSPORT":
                                                  " TCP "})
    assert ok.recover_in_place
    with pytest.raises(launch_config.UsageError, match=(
            "^--recover-in-place in node mode needs the TCP transport")):
        launch_config.parse_args(["--nnodes", "1", "--recover-in-place",
                                  "x"], environ={})
    with pytest.raises(launch_config.UsageError, match=(
            "^KERASDIST_TRANSPORT='udp': the transports are mpi and tcp "
            r"\(the default: mpi\), in the launcher's environment$")):
        launch_config.parse_args(["--nnodes", "1", "x"],
                                 environ={"KERASDIST_TRANSPORT": "udp"})


@pytest.mark.parametrize("flags, environ, line", [
    (["--nnodes", "2"], {}, "--nnodes does not go with --join: the running "
     "job numbers the processes that join it"),
    (["--master-addr", "h"], {}, "--join needs --master-addr and "
     "--master-port"),
    (["--master-addr", "h", "--master-port", "1234"],
     {"KERASDIST_TRANSPORT": "mpi"}, "--join needs the TCP transport "
     "(KERASDIST_TRANSPORT=tcp in the launcher's environment)"),
])
def test_parse_args_checks_join(flags, environ, line):
    with pytest.raises(launch_config.UsageError) as e:
        launch_config.parse_args(["--join", *flags, "x"], environ=dict(
            {"KERASDIST_TRANSPORT": "tcp"}, **environ))
    assert str(e.value).startswith(line), str(e.value)


def test_join_recovers_in_place_and_its_ranks_are_numbered_by_the_job():
    args = launch_config.parse_args(
        ["--join", "--nproc-per-node", "2", "--master-addr", "h",
         "--master-port", "1234", "x"],
        environ={"KERASDIST_TRANSPORT": "tcp"})
    assert args.join and args.recover_in_place and args.np == 2
    env = node.rank_env(args.node, 1, join=True)
    assert env == {"KERASDIST_JOIN": "1", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
                   "MASTER_PORT": "1234"}
    assert _rank.rank_from_env(env) == "+1"


def test_wrapper_reads_node_modes_variables():
    env = {"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert _rank.rank_from_env(env) == "3"
    assert _rank.local_rank_from_env(env) == (1, 2)
    # MPI's own variables come first.
    assert _rank.rank_from_env(dict(env, PMI_RANK="0")) == "0"
