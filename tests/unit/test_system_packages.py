"""The Debian packages the tests need: one list (tools/system-packages.txt)
read by the installer (tools/system-packages.sh), by the tests' skips
(tests/support/system.py) and named in the README, whose test command CI
runs as written (tools/readme-command.sh)."""

import os
import shutil
import subprocess

import pytest

from tests.support import system
from tests.support.helpers import REPO_ROOT

pytestmark = pytest.mark.unit

SCRIPT = os.path.join(REPO_ROOT, "tools", "system-packages.sh")


def _readme():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_ci_runs_the_readmes_test_command_which_installs_the_packages():
    command = subprocess.run(
        [os.path.join(REPO_ROOT, "tools", "readme-command.sh"), "tests"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert command.startswith("tools/system-packages.sh && "), command
    assert command.endswith("&& make test"), command
    assert f"\n    {command}\n" in _readme()
    with open(os.path.join(REPO_ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert 'command="$(tools/readme-command.sh tests)"' in ci
    assert 'bash -c "$command"' in ci


def test_every_package_is_named_in_the_readme():
    readme = _readme()
    table = system.packages()
    assert {"nftables", "openssh-server", "slurmd", "libpmix-dev"} <= set(
        table)
    assert [p for p in table if p not in readme] == []
    for probe, purpose in table.values():
        assert probe.split(":")[0] in ("command", "lib"), probe
        assert purpose


def test_the_script_and_the_tests_find_the_same_packages_missing():
    out = subprocess.run([SCRIPT, "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    gone = system.missing(*system.packages())
    if gone:
        assert f"missing {' '.join(gone)};" in out.stdout, out.stdout
    else:
        assert "all the tests need are here" in out.stdout, out.stdout


def _with_list(tmp_path, monkeypatch, extra):
    """The script and a copy of the list with `extra` lines appended."""
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(SCRIPT, tools)
    with open(system.LIST, encoding="utf-8") as f:
        text = f.read()
    (tools / "system-packages.txt").write_text(text + extra)
    monkeypatch.setattr(system, "LIST", str(tools / "system-packages.txt"))
    return str(tools / "system-packages.sh")


def test_a_missing_package_is_listed_with_the_command_to_install_it(
        tmp_path, monkeypatch):
    script = _with_list(
        tmp_path, monkeypatch,
        "kd-absent-tool  command:kd-no-such-tool  a check of this test\n"
        "kd-absent-lib   lib:libkd-no-such.so.9   a check of this test\n")
    out = subprocess.run([script, "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kd-absent-tool kd-absent-lib;" in out.stdout, out.stdout
    assert "apt-get install " in out.stdout and "skip" in out.stdout
    assert system.missing("kd-absent-tool", "kd-absent-lib") == [
        "kd-absent-tool", "kd-absent-lib"]
    bad = subprocess.run([script, "--bogus"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_a_test_needing_a_missing_package_skips_naming_it(
        tmp_path, monkeypatch):
    _with_list(tmp_path, monkeypatch,
               "kd-absent-tool  command:kd-no-such-tool  a check\n")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        system.require("kd-absent-tool")
    assert "kd-absent-tool" in str(skipped.value)
    assert "apt-get install kd-absent-tool" in str(skipped.value)
    # CI installs every package: there a missing one fails the test.
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as failed:
        system.require("kd-absent-tool")
    assert "CI=true" in str(failed.value)
    with pytest.raises(KeyError):
        system.require("not-in-the-list")
