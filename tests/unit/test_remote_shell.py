"""The launcher's remote shell: --ssh-command, the pre-flight host check and
hydra's arguments. Small real scripts stand in for ssh; no MPI, no network."""

import os
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from kerasdist.run import launch  # noqa: E402
from kerasdist.run import launch_config  # noqa: E402
from kerasdist.run import mpi_command  # noqa: E402
from kerasdist.run import remote  # noqa: E402

# Called like ssh: [-x] HOST COMMAND. "bad" does not resolve, "slow" never
# answers, any other host runs the command here.
_SHELL = """#!/bin/sh
[ "$1" = -x ] && shift
case "$1" in
  bad) echo "ssh: Could not resolve hostname bad: Name or service not known" >&2
       exit 255 ;;
  slow) exec sleep 60 ;;
esac
shift
exec sh -c "$*"
"""


@pytest.fixture
def shell(tmp_path):
    path = tmp_path / "fake-ssh"
    path.write_text(_SHELL)
    path.chmod(0o755)
    return str(path)


def test_build_mpiexec_argv_remote_shell_and_interface():
    argv = mpi_command.build_mpiexec_argv(
        "mpiexec", 4, ["c"], {}, hosts=[("a", 2), ("b", 2)], python="/py",
        launcher_exec="/bin/rsh-like", iface="eth1")
    i = argv.index("-launcher")
    assert argv[i:i + 6] == ["-launcher", "ssh", "-launcher-exec",
                             "/bin/rsh-like", "-iface", "eth1"]
    assert argv.index("-hosts") < i < argv.index("-n")
    plain = mpi_command.build_mpiexec_argv("mpiexec", 2, ["c"], {},
                                           python="/py")
    assert "-launcher" not in plain and "-iface" not in plain


def test_ssh_command_from_flag_or_environment(monkeypatch):
    args = launch_config.parse_args(["-np", "2", "--ssh-command",
                                     "ssh -p 2222 -o 'A=b c'", "cmd"])
    assert args.ssh_argv == ("ssh", "-p", "2222", "-o", "A=b c")
    monkeypatch.setenv(remote.SSH_COMMAND, "my-rsh --fast")
    assert launch_config.parse_args(["-np", "2", "cmd"]).ssh_argv == (
        "my-rsh", "--fast")
    assert launch_config.parse_args(["-np", "2", "--ssh-command", "x", "cmd"]
                                    ).ssh_argv == ("x",)
    monkeypatch.delenv(remote.SSH_COMMAND)
    assert launch_config.parse_args(["-np", "2", "cmd"]).ssh_argv is None


@pytest.mark.parametrize("value, message", [
    ("", "expected a command"), ("   ", "expected a command"),
    ("ssh 'unclosed", "cannot split")])
def test_ssh_command_rejects(value, message):
    with pytest.raises(launch_config.UsageError, match=message):
        launch_config.parse_args(["-np", "2", "--ssh-command", value, "cmd"])


def test_launcher_exec_wraps_a_command_with_arguments(tmp_path):
    single = remote.launcher_exec(["sh"], str(tmp_path))
    assert os.path.isabs(single) and os.path.basename(single) == "sh"
    assert os.listdir(tmp_path) == []  # one word needs no script
    code = "import sys; print(sys.argv[1:])"
    exe = remote.launcher_exec([sys.executable, "-c", code, "fixed arg"],
                               str(tmp_path))
    out = subprocess.run([exe, "-x", "host", "cmd 'q'"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == str(["fixed arg", "-x", "host", "cmd 'q'"])


def test_effective_command():
    assert remote.effective_command(["a", "b"], {}) == ["a", "b"]
    assert remote.effective_command(None, {}) == ["ssh"]
    assert remote.effective_command(None, {"HYDRA_LAUNCHER_EXEC": "/x"}) == [
        "/x"]
    assert remote.effective_command(None, {"HYDRA_LAUNCHER": "rsh"}) == [
        "rsh"]
    assert remote.effective_command(None, {"HYDRA_LAUNCHER": "slurm"}) is None


def test_is_local_looks_nothing_up():
    assert remote.is_local("localhost")
    assert remote.is_local(socket.gethostname())
    assert remote.is_local("127.0.0.1")
    # TEST-NET-3 (RFC 5737): not this machine's; only bound, never sent to.
    assert not remote.is_local("203.0.113.7")
    assert not remote.is_local("node-that-is-not-here")


def test_check_hosts_names_each_failure(shell):
    start = time.monotonic()
    failed = remote.check_hosts(["ok1", "bad", "slow", "ok2"], [shell],
                                timeout=2.0)
    assert time.monotonic() - start < 10
    assert failed == [
        ("bad", "ssh: Could not resolve hostname bad: Name or service not "
                "known"),
        ("slow", "no answer within 2 s")]
    assert remote.check_hosts(["ok1"], [shell, "-x"]) == []
    missing = remote.check_hosts(["a"], ["/nonexistent/ssh"])
    assert missing[0][0] == "a" and "cannot run" in missing[0][1]


def test_main_names_the_host_and_starts_nothing(shell, tmp_path, capfdbinary):
    marker = tmp_path / "started"
    rc = launch.main(["--ssh-command", shell, "-np", "2", "-H", "ok:1,bad:1",
                      "touch", str(marker)])
    err = capfdbinary.readouterr().err.decode()
    assert rc == 1
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kerasdist run: error: cannot start ranks on "
                               "host bad: ")
    assert "Could not resolve hostname bad" in lines[0]
    assert not marker.exists()


def test_a_proxy_that_cannot_connect_back_ends_the_job(capfdbinary):
    # A stand-in for mpiexec under srun: hydra's proxy message, then a wait
    # that would never end by itself.
    from kerasdist.run import job
    line = ("[proxy:1@node2] main (/src/pm/hydra/proxy/pmip.c:100): unable "
            "to connect to server head at port 4242 (check for firewalls!)")
    argv = ["sh", "-c", f"echo '{line}' >&2; exec sleep 60"]
    start = time.monotonic()
    with job.Interrupts() as interrupts:
        outcome = job.run_attempt(argv, dict(os.environ), interrupts)
    assert time.monotonic() - start < 10
    assert outcome.exit_code == 1 and not outcome.retryable
    err = capfdbinary.readouterr().err.decode().splitlines()
    assert err == [line, "kerasdist: host node2 could not connect back to "
                   "this machine at head:4242; give the interface the hosts "
                   "reach this machine on with --network-interface (hydra's "
                   "-iface)."]


def test_the_host_check_listens_only_where_the_hosts_connect(tmp_path):
    # The check before a restart (elastic.answering) listens for the
    # hosts' probes on the address it gives them, not on every interface.
    # The "remote shell" runs the probe here, after noting its argv and
    # which sockets listen then (as `ss -ltn` would).
    from kerasdist.run import elastic
    seen, argv = tmp_path / "tcp", tmp_path / "argv"
    shell = ["sh", "-c", f'shift; cat /proc/net/tcp > {seen}; '
             f'echo "$@" > {argv}; exec "$@"', "fake-ssh"]
    ok, failed = elastic.answering([("far-host", 2)], shell, iface="lo",
                                   timeout=10)
    assert ok == [("far-host", 2)] and failed == []
    # The probe's argv ends ADDRESS PORT TIMEOUT.
    address, port = argv.read_text().split()[-3:-1]
    assert address == elastic.launcher_address("lo") == "127.0.0.1"
    listening = []
    for row in seen.read_text().splitlines()[1:]:
        fields = row.split()
        local_ip, local_port = fields[1].split(":")
        if fields[3] == "0A" and int(local_port, 16) == int(port):  # LISTEN
            listening.append(socket.inet_ntoa(bytes.fromhex(local_ip)[::-1]))
    assert listening == ["127.0.0.1"]
