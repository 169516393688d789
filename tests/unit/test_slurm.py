"""Hosts and slots from a Slurm allocation's variables, and what the launcher
does with them. Pure functions; no Slurm needed."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.run import launch_config  # noqa: E402
from kerasdist.run import slurm  # noqa: E402


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("a,b", ["a", "b"]),
    ("node[01-04,07],gpu-a1",
     ["node01", "node02", "node03", "node04", "node07", "gpu-a1"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("gpu[1-2]a,cpu7", ["gpu1a", "gpu2a", "cpu7"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_expand_nodelist(text, hosts):
    assert slurm.expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, message", [
    ("n[1-", "without"), ("n]", "without"), ("n[[1]]", "nested"),
    ("a,,b", "empty"), ("n[3-1]", "backwards"), ("n[a-b]", "N-M"),
    ("n[]", "N-M"), ("", "empty"),
])
def test_expand_nodelist_rejects(text, message):
    with pytest.raises(ValueError, match=message) as e:
        slurm.expand_nodelist(text)
    assert "SLURM_JOB_NODELIST" in str(e.value)


@pytest.mark.parametrize("text, counts", [
    ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1(x2)", [1, 1]),
    ("3,2(x2),1(x1)", [3, 2, 2, 1]),
])
def test_expand_tasks_per_node(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x2", "2(3)", "-1", "2,,1"])
def test_expand_tasks_per_node_rejects(text):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        slurm.expand_tasks_per_node(text)


ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "kdt[0-1]",
       "SLURM_TASKS_PER_NODE": "2(x2)"}


def test_allocation():
    assert slurm.allocation(ENV) == [("kdt0", 2), ("kdt1", 2)]
    assert slurm.allocation({}) is None
    assert slurm.allocation({"SLURM_JOB_NODELIST": "a"}) is None
    assert slurm.allocation({"SLURM_JOB_ID": "1",
                             "SLURM_JOB_NODELIST": "a,b"}) == [("a", 1),
                                                               ("b", 1)]
    with pytest.raises(ValueError, match="gives 1 node"):
        slurm.allocation(dict(ENV, SLURM_TASKS_PER_NODE="4"))


def test_np_defaults_to_the_allocation_and_may_not_exceed_it():
    args = launch_config.parse_args(["python", "t.py"], environ=ENV)
    assert args.np == 4 and args.hosts is None
    assert args.slurm == (("kdt0", 2), ("kdt1", 2))
    assert launch_config.parse_args(["-np", "3", "cmd"], environ=ENV).np == 3
    with pytest.raises(launch_config.UsageError,
                       match=r"-np 5 is more than the 4 task\(s\) of this "
                       r"Slurm allocation \(SLURM_TASKS_PER_NODE=2\(x2\)\)"):
        launch_config.parse_args(["-np", "5", "cmd"], environ=ENV)
    with pytest.raises(launch_config.UsageError,
                       match="required outside a Slurm"):
        launch_config.parse_args(["cmd"], environ={})


def test_hosts_given_inside_an_allocation_win_but_must_belong_to_it():
    args = launch_config.parse_args(["-H", "kdt1:2", "cmd"], environ=ENV)
    assert args.hosts == (("kdt1", 2),) and args.np == 2
    with pytest.raises(launch_config.UsageError,
                       match="host other is not in this Slurm allocation"):
        launch_config.parse_args(["-H", "kdt0:2,other:2", "cmd"], environ=ENV)
    with pytest.raises(launch_config.UsageError, match="SLURM_JOB_NODELIST"):
        launch_config.parse_args(["cmd"], environ=dict(
            ENV, SLURM_JOB_NODELIST="n["))
