"""Growing and shrinking a running job: `--host-discovery-script` polled
while the job runs (Horovod Elastic's interface, torchrun's way of acting
on it).

While an attempt runs, a thread runs the discovery script every
`--discovery-interval` seconds. When the hosts it lists would give another
number of ranks (more hosts: up to `--max-np`; fewer: not below
`--min-np`), the launcher asks the ranks to stop at their next checkpoint
boundary: SIGUSR1 to mpiexec, which hydra forwards to every rank's wrapper
(kerasdist/run/_rank.py), which forwards it to the command. The Trainer
(kerasdist/trainer/) has kd.init()'s handler note it; at each step
checkpoint boundary the ranks agree on it in one small allreduce, write that
step's checkpoint and exit with RESIZE_EXIT_CODE. The launcher then starts
the next attempt on the hosts listed now, and the Trainer resumes there as
after a failure. A resize does not use up `--max-restarts`.

A host listed for the first time must answer (elastic.answering) before the
job grows onto it. The launcher only asks once a rank has said that it
checks for resize requests (the Trainer does, at the start of `fit()`,
and `hvd.elastic.run` (kerasdist/elastic.py) before it calls its function,
with one marker line the launcher removes from the output); a command that
never says so keeps its size, and the launcher says so in one line.

Standard library only.
"""

import collections
import signal
import threading
import time

from kerasdist.run import _rank
from kerasdist.run import elastic
from kerasdist.run import hosts as hosts_lib

DEFAULT_INTERVAL_S = 5.0
# How long, from the start of an attempt, the command has to say that it
# checks for resize requests (TensorFlow's import and the model's build come
# first), before the launcher says that it goes on at its size.
ANNOUNCE_WAIT_S = 60.0

RESIZE_EXIT_CODE = _rank.RESIZE_EXIT_CODE

class Change(collections.namedtuple("Change", ["old_np", "new_np", "hosts",
                                                "why"])):
    """A resize the launcher decided on: from old_np to new_np ranks, onto
    `hosts` ([(host, slots), ...], those listed that answer); `why` says
    what changed ("host kdt1 joined")."""

    @property
    def line(self):
        """"growing from 1 to 2 ranks: host kdt1 joined"."""
        verb = "growing" if self.new_np > self.old_np else "shrinking"
        return f"{verb} from {self.old_np} to {self.new_np} ranks: {self.why}"


def what_changed(old_hosts, new_hosts):
    """"host b joined, host c left" from two [(host, slots), ...]."""
    old, new = dict(old_hosts or ()), dict(new_hosts or ())
    why = [f"host {h} joined" for h in new if h not in old]
    why += [f"host {h} left" for h in old if h not in new]
    why += [f"host {h} has {new[h]} slot(s) now, not {old[h]}"
            for h in new if h in old and new[h] != old[h]]
    return ", ".join(why) or "the hosts changed"


def decide(np_, hosts, listed, min_np, max_np):
    """What the hosts listed now mean for a job of np_ ranks on `hosts`.

    Args:
        np_: the ranks the job runs with.
        hosts: [(host, slots), ...] it runs on.
        listed: [(host, slots), ...] listed now, of which those the job
            does not run on have answered.
        min_np, max_np: the bounds (--min-np, --max-np).

    Returns:
        A Change; None when the number of ranks stays; or the string
        "too few" when the listed hosts have fewer than min_np slots (the
        job then goes on at its size: ranks that are really gone end it
        through the failure path).
    """
    new_np = elastic.ranks_for(max_np, min_np, listed)
    if new_np is None:
        return "too few"
    if new_np == np_:
        return None
    return Change(np_, new_np, list(listed), what_changed(hosts, listed))


class Watcher:
    """Watches the discovery script during one attempt, and asks the ranks
    to stop for a resize (see the module's doc).

    Args:
        discover: () -> [(host, slots), ...] listed now; raises ValueError
            when the script fails.
        answering: (hosts) -> ([(host, slots)] that answer, [(host,
            reason)] that don't), for the hosts the job does not run on.
        np_, hosts: the attempt's ranks and hosts.
        min_np, max_np: the bounds.
        interval: seconds between two runs of the script.
        log: a job.Log.
        started: clock() at the attempt's start (default: now).
        announce_wait: see ANNOUNCE_WAIT_S.
        clock: the clock of `started` and of step()'s `now`.
        grow: (change, hosts) -> None that asks the ranks to grow or
            shrink in place (kerasdist/run/grow.py's writer; it returns
            why not instead where it cannot), or None: a Change is then
            asked for with it, and the attempt goes on at its new size
            instead of ending.
        signal_in_place: whether a resize in place is also asked with
            SIGUSR1 (the ranks read the request at their next commit);
            over TCP the new ranks join by themselves (tcp_launch.py).
    """

    def __init__(self, discover, answering, np_, hosts, min_np, max_np,
                 interval, log, started=None, announce_wait=ANNOUNCE_WAIT_S,
                 clock=time.monotonic, grow=None, signal_in_place=True):
        self._discover = discover
        self._answering = answering
        self.np = np_
        self.hosts = list(hosts or ())
        self.min_np = min_np
        self.max_np = max_np
        self.interval = interval
        self.log = log
        self._clock = clock
        self._grow = grow
        self._signal_in_place = signal_in_place
        self.started = clock() if started is None else started
        self.announce_wait = announce_wait
        self.change = None  # the Change waiting to be asked for
        self.change_seen = None  # when it was first seen
        self.requested = None  # the Change the ranks were asked for
        self.requested_at = None
        # The Change last asked for in place: the ranks may still decline
        # it (a grow with sharded state) and stop for a relaunch.
        self.in_place = None
        self._said = set()  # one-off lines already printed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    # -- the polling thread -------------------------------------------------

    def start(self):
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="kerasdist-discovery")
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=elastic.PROBE_TIMEOUT_S + 5)

    def _loop(self):
        while not self._stop.wait(self.interval):
            if self.requested is not None:
                return
            self.poll()

    def _say_once(self, key, text):
        if key not in self._said:
            self._said.add(key)
            self.log.line(text)

    def poll(self):
        """Runs the script once and notes the Change it implies, if any."""
        try:
            listed = self._discover()
        except ValueError as e:
            self._say_once(("failed", str(e)),
                           f"{e}; the job goes on at {self.np} rank(s).")
            return
        running = {h for h, _ in self.hosts}
        new = [(h, s) for h, s in listed if h not in running]
        if new:
            ok, failed = self._answering(new)
            for host, reason in failed:
                self._say_once(("silent", host),
                               f"host {host} is listed but does not answer "
                               f"({reason}); not using it yet.")
            ok = set(h for h, _ in ok)
            listed = [(h, s) for h, s in listed if h in running or h in ok]
        decision = decide(self.np, self.hosts, listed, self.min_np,
                          self.max_np)
        if decision == "too few":
            slots = hosts_lib.total_slots(listed) if listed else 0
            self._say_once(("few", tuple(listed)),
                           f"the hosts listed now have {slots} slot(s) "
                           f"({hosts_lib.hydra_hosts_arg(listed) or 'none'}),"
                           f" fewer than --min-np {self.min_np}; the job "
                           f"goes on at {self.np} rank(s).")
            decision = None
        with self._lock:
            if decision is None:
                self.change = self.change_seen = None
            elif self.change is None or \
                    self.change.new_np != decision.new_np:
                self.change, self.change_seen = decision, self._clock()
            else:
                self.change = decision  # same size, hosts may differ

    # -- the launcher's loop ------------------------------------------------

    def step(self, now, resizable, proc, grows_in_place=False,
             shrinks_in_place=None):
        """Asks the ranks to stop (SIGUSR1 to `proc`, mpiexec) once a
        Change is waiting and a rank said it checks (`resizable`); says
        once when none has, ANNOUNCE_WAIT_S into the attempt. A Change
        that grows is asked in place (`grow`) only where the ranks said
        they grow in place (`grows_in_place`: hvd.elastic.run, not the
        Trainer), else by a relaunch; one that shrinks only where they
        said they shrink in place (`shrinks_in_place`, by default
        `grows_in_place`: hvd.elastic.run and the Trainer)."""
        with self._lock:
            change = self.change
            seen = self.change_seen
        if change is None or self.requested is not None:
            return
        if shrinks_in_place is None:
            shrinks_in_place = grows_in_place
        in_place = grows_in_place if change.new_np > change.old_np else \
            shrinks_in_place
        if resizable and in_place and self._grow is not None and \
                self._grow_in_place(change):
            if self._signal_in_place:
                _signal(proc)
            return
        if resizable:
            self.requested, self.requested_at = change, now
            self.log.line(change.line)
            _signal(proc)
            self._stop.set()
            return
        if now >= max(self.started + self.announce_wait,
                      seen + 2 * self.interval):
            self._say_once("unannounced",
                           f"the hosts listed now would give "
                           f"{change.new_np} rank(s) ({change.why}), but "
                           f"the job's command does not check for resize "
                           f"requests (kerasdist.Trainer with a "
                           f"checkpoint_dir does, and hvd.elastic.run): it "
                           f"goes on at "
                           f"{self.np} rank(s).")

    def _grow_in_place(self, change):
        """Writes the grow (or shrink) request of `change`; from then on
        the attempt runs at its new size. False when it cannot resize in
        place, said in one line (the ranks then stop for a relaunch
        instead)."""
        verb = "grow" if change.new_np > change.old_np else "shrink"
        try:
            why_not = self._grow(change, self.hosts)
        except OSError as e:
            why_not = f"the request cannot be written: {e}"
        if why_not:
            self.log.line(f"cannot {verb} in place ({why_not}); relaunching "
                          f"instead.")
            return False
        self.log.line(f"{change.line}; in place, at the ranks' next commit")
        hosts = list(change.hosts)
        if verb == "shrink":
            # The ranks that stay keep their order: the hosts in the job's.
            order = [h for h, _ in self.hosts]
            hosts.sort(key=lambda h: order.index(h[0]) if h[0] in order
                       else len(order))
        with self._lock:
            self.np, self.hosts = change.new_np, hosts
            self.change = self.change_seen = None
            self.in_place = change
        return True


def _signal(proc):
    """The resize request: SIGUSR1 to mpiexec, which forwards it."""
    try:
        proc.send_signal(signal.SIGUSR1)
    except (ProcessLookupError, OSError):
        pass
