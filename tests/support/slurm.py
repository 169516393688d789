"""A real Slurm on a test cluster: munged and slurmctld on the machine (at
the bridge address), one slurmd inside each test host.

    with Cluster(2) as c, Slurm(c) as s:
        subprocess.run(s.prefix() + ["salloc", "-N2", "-n4", ...], env=s.env())

Everything is the test's own: the munge key and socket, slurm.conf, state,
spool and log files live in a temporary directory; nothing under /etc is
used. Needs Debian's slurmctld, slurmd and munge (see unavailable_reason).
Standard library only.
"""

import os
import shutil
import signal
import socket
import subprocess
import time

from tests.support import system

# The Debian packages of munged, slurmctld, slurmd and salloc/srun/sinfo.
PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")


def unavailable_reason():
    """Why Slurm cannot run here, or None when it can."""
    return system.reason(*PACKAGES)


def _die_with_parent():
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _which(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Slurm:
    """munged + slurmctld + one slurmd per host of `cluster`.

    Args:
        cluster: a tests.support.cluster.Cluster.
        cpus: CPUs each test host offers to Slurm.
    """

    def __init__(self, cluster, cpus=2):
        self.cluster = cluster
        self.dir = os.path.join(cluster.dir, "slurm")
        os.makedirs(self.dir)
        self.procs = []
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.socket = os.path.join(self.dir, "munge.socket")
        try:
            self._munge()
            self._write_conf(cpus)
            self._start_slurmctld()
            for host in cluster.hosts:
                self._start_slurmd(host)
            self.wait_idle()
        except BaseException:
            self.close()
            raise

    def _log(self, name):
        return os.path.join(self.dir, f"{name}.log")

    def _spawn(self, argv, name):
        with open(self._log(name + ".out"), "wb") as out:
            # The daemons die with the test process, even when it is
            # SIGKILLed (the slurmds also go with their hosts).
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=_die_with_parent)
        self.procs.append(proc)
        return proc

    def _munge(self):
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o400)
        # --origin: no lookup of the machine's name; -f: the directory is
        # the test's own, not /etc/munge with munge's ownership rules.
        self._spawn([_which("munged"), "-F", "-f", f"--key-file={key}",
                     f"--socket={self.socket}",
                     f"--pid-file={self.dir}/munged.pid",
                     f"--log-file={self._log('munged')}",
                     f"--seed-file={self.dir}/munged.seed",
                     f"--origin={self.cluster.address}"], "munged")
        self._wait(lambda: os.path.exists(self.socket), "munged")

    def _write_conf(self, cpus):
        c = self.cluster
        self.controller = socket.gethostname()
        names = ",".join(h.name for h in c.hosts)
        nodes = "".join(
            f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} "
            "State=UNKNOWN\n" for h in c.hosts)
        d = self.dir
        with open(self.conf, "w") as f:
            f.write(f"""\
ClusterName=kdt
SlurmctldHost={self.controller}({c.address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={self._log('slurmctld')}
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
# Per host (each has its own /dev/shm): srun --mpi=pmix's directories are
# named by job and step, and the hosts share /tmp.
TmpFS=/dev/shm
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
{nodes}PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP
""")
        os.makedirs(f"{d}/state")

    def _start_slurmctld(self):
        self._spawn(self.cluster.launcher_prefix() + [
            _which("slurmctld"), "-D", "-i", "-f", self.conf], "slurmctld")

    def _start_slurmd(self, host):
        self._spawn(host.nsenter() + [_which("slurmd"), "-D", "-f",
                                      self.conf], f"slurmd-{host.name}")

    def env(self, base=None):
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    def prefix(self):
        """Runs a Slurm client where the host names resolve."""
        return self.cluster.launcher_prefix()

    def sinfo(self):
        out = subprocess.run(self.prefix() + [_which("sinfo"), "-h", "-N",
                                              "-o", "%N %t"],
                             capture_output=True, text=True, env=self.env(),
                             timeout=30)
        return out.stdout + out.stderr

    def wait_idle(self, timeout=60.0):
        want = {h.name for h in self.cluster.hosts}

        def idle():
            states = dict(l.split()[:2] for l in self.sinfo().splitlines()
                          if len(l.split()) >= 2)
            return all(states.get(n) == "idle" for n in want)
        self._wait(idle, "slurmd on every host (sinfo: idle)", timeout)

    def wait_jobs_done(self, timeout=30.0):
        """Waits until the controller lists no job, completing ones
        included: `salloc` and `srun` return before the hosts' step
        daemons (slurmstepd) have ended, and a test that ends then
        leaves them running."""
        def none():
            out = subprocess.run(
                self.prefix() + [_which("squeue"), "-h", "-o", "%i %t"],
                capture_output=True, text=True, env=self.env(), timeout=30)
            return out.returncode == 0 and not out.stdout.strip()
        self._wait(none, "end of every Slurm job (squeue: empty)", timeout)

    def _wait(self, predicate, what, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{p.args[-1] if p.args else p}: exited with "
                        f"{p.returncode} while waiting for {what}; logs in "
                        f"{self.dir}: {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {timeout:g} s; "
                                   f"{self.logs()}")
            time.sleep(0.3)

    def logs(self):
        text = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".log"):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    tail = f.read()[-1500:]
                text.append(f"--- {name} ---\n{tail}")
        return "\n".join(text)

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
