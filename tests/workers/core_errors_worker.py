"""Bad input and failures through the core's C API: each mode is one scenario.

    python core_errors_worker.py MODE
"""

import os
import sys
import time

import numpy as np

import kerasdist as kd
from kerasdist._core.capi import KerasdistError
from tests.support.collectives import allreduce
from tests.support.collectives import broadcast
from tests.support.collectives import start_allreduce

mode = sys.argv[1]


def expect_error(fn, *needles):
    try:
        fn()
    except KerasdistError as e:
        text = str(e)
        missing = [s for s in needles if s not in text]
        if missing:
            print(f"FAIL error lacks {missing}: {text}", flush=True)
            sys.exit(1)
        return text
    print(f"FAIL no error (wanted {needles})", flush=True)
    sys.exit(1)


if mode == "init":
    try:
        kd.rank()
        sys.exit("FAIL rank() before init did not raise")
    except RuntimeError as e:
        assert "kerasdist.init()" in str(e), e
    try:
        kd.init(fusion_treshold=1)
        sys.exit("FAIL unknown setting accepted")
    except ValueError as e:
        assert "fusion_treshold" in str(e), e
    try:
        kd.init(fusion_threshold="64MB")
        sys.exit("FAIL malformed threshold accepted")
    except ValueError as e:
        assert "KERASDIST_FUSION_THRESHOLD" in str(e) and "64MB" in str(e), e
    kd.init()
    r, n = kd.rank(), kd.size()
    assert allreduce(np.ones(3), "a", op=kd.Sum).tolist() == [n] * 3
    kd.shutdown()
    assert not kd.is_initialized()
    kd.init(cycle_time_ms=0.2)  # a second life, with other settings
    assert kd.current_settings()["KERASDIST_CYCLE_TIME"] == "0.2"
    assert allreduce(np.ones(3), "a", op=kd.Sum).tolist() == [n] * 3
    kd.shutdown()
    # back-to-back lives: a shutdown notice still in flight from one life must
    # not reach the next (MPI may reuse the freed communicator's context id)
    for life in range(6):
        kd.init()
        assert allreduce(np.ones(2), f"life.{life % 2}",
                         op=kd.Sum).tolist() == [n] * 2
        kd.shutdown()
    print("OK init", flush=True)

elif mode == "comm":
    # init(comm=...) with an mpi4py sub-communicator: ranks 0..n-2 form one
    # job and the last rank a job of its own.
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    last = world.rank == world.size - 1
    sub = world.Split(color=1 if last else 0, key=world.rank)
    kd.init(comm=sub)
    want_size = 1 if last else world.size - 1
    assert kd.size() == want_size and kd.rank() == sub.rank, \
        (kd.size(), kd.rank())
    got = allreduce(np.array([world.rank], np.int64), "who", op=kd.Sum)
    want = world.rank if last else sum(range(world.size - 1))
    assert got.tolist() == [want], (got, want)
    # user MPI traffic on the same communicator does not mix with kerasdist's
    assert sub.allreduce(1) == want_size
    kd.shutdown()
    try:
        kd.init(comm="world")
        sys.exit("FAIL a non-communicator was accepted")
    except TypeError as e:
        assert "mpi4py communicator" in str(e), e
    print("OK comm", flush=True)

elif mode == "mismatch":
    kd.init()
    r, n = kd.rank(), kd.size()
    t = expect_error(lambda: allreduce(np.zeros(2 + (r == n - 1)), "shape.x"),
                     "Mismatched shape", "'shape.x'", f"rank {n - 1}",
                     "[2]", "[3]")
    print(f"OK shape: {t}", flush=True)
    dt = np.float32 if r == 0 else np.float64
    expect_error(lambda: allreduce(np.zeros(2, dt), "dtype.x"),
                 "Mismatched dtype", "'dtype.x'", "rank 0 sent float32",
                 "float64")
    expect_error(lambda: allreduce(np.zeros(2), "op.x",
                                   op=kd.Sum if r == 0 else kd.Max),
                 "Mismatched reduction op", "Sum", "Max")
    expect_error(lambda: broadcast(np.zeros(2), r % 2 if n > 1 else 0,
                                   "root.x"),
                 "Mismatched root rank", "'root.x'")
    if kd.nccl_built() and n > 1:
        # Host memory on rank 0, "GPU memory" elsewhere (ordinals differ
        # between ranks, which alone is fine): refused in negotiation, before
        # any device is touched.
        from kerasdist._core import capi as _c
        x = np.zeros(4, np.float32)

        def mixed():
            _c.Handle(_c.OP_ALLREDUCE, "device.x", _c.DTYPES[x.dtype],
                      x.shape, x.ctypes.data, x.ctypes.data, reduce_op=kd.Sum,
                      device=-1 if r == 0 else r - 1).wait(60)
        expect_error(mixed, "Mismatched device", "'device.x'", "host memory",
                     "GPU memory")
    # the runtime survives a mismatch: the next collective works
    assert allreduce(np.ones(2), "after", op=kd.Sum).tolist() == [n, n]
    # the same name twice at once on one rank (rank 0): the other ranks
    # submit "dup" only after rank 0's check (the gate), so it is still in
    # flight there, not completed and gone (or their runtime shut down)
    if r == 0:
        h1 = start_allreduce(np.ones(4), "dup", op=kd.Sum)
        try:
            start_allreduce(np.ones(4), "dup", op=kd.Sum)
            sys.exit("FAIL duplicate name accepted")
        except KerasdistError as e:
            assert "already in flight" in str(e), e
    allreduce(np.ones(1), "dup.gate", op=kd.Sum)
    if r != 0:
        h1 = start_allreduce(np.ones(4), "dup", op=kd.Sum)
    h1[0].wait(60)
    expect_error(lambda: broadcast(np.zeros(2), n + 3, "badroot"),
                 "root_rank must be in")
    print("OK mismatch", flush=True)
    kd.shutdown()

elif mode == "callback":
    # kerasdist_enqueue_cb, the seam the JAX handlers use, driven through
    # ctypes: results, core-owned outputs, received splits and failures
    # reach the callback, which runs on the core's thread, once.
    import ctypes
    import threading

    from kerasdist._core import capi as c
    kd.init()
    r, n = kd.rank(), kd.size()
    lib = c.lib()

    def enqueue_cb(op, name, x, out=None, splits=(), dtype=None):
        shape = (ctypes.c_int64 * max(x.ndim, 1))(*x.shape)
        sp = (ctypes.c_int64 * max(len(splits), 1))(*splits)
        req = c._Request(name=name.encode(), op=op, reduce_op=kd.Sum,
                         dtype=c.DTYPES[x.dtype] if dtype is None else dtype,
                         ndim=x.ndim, shape=shape, prescale=1.0,
                         postscale=1.0, nsplits=len(splits), splits=sp,
                         group=b"", device=-1)
        got, done = {"calls": 0}, threading.Event()

        def on_done(arg, res):
            res = res.contents
            got["calls"] += 1
            got["thread"] = threading.get_ident()
            got["status"], got["message"] = res.status, res.message.decode()
            got["shape"] = [res.shape[i] for i in range(res.ndim)]
            got["splits"] = [res.recv_splits[i] for i in range(res.nsplits)]
            nbytes = int(np.prod(got["shape"])) * x.itemsize
            got["data"] = (np.frombuffer(ctypes.string_at(res.data, nbytes),
                                         x.dtype).reshape(got["shape"])
                           if res.data else None)
            done.set()

        fn = c.DONE_FN(on_done)
        rc = lib.kerasdist_enqueue_cb(
            ctypes.byref(req), x.ctypes.data if x.size else None,
            None if out is None else out.ctypes.data, None, fn, None)
        if rc != 0:
            return c.last_error()
        assert done.wait(60), f"{name}: no callback"
        time.sleep(0.05)  # a second call would come now
        assert got["calls"] == 1, got
        assert got["thread"] != threading.get_ident(), got
        return got

    x = np.full(3, r + 1.0)
    out = np.empty_like(x)
    got = enqueue_cb(c.OP_ALLREDUCE, "cb.sum", x, out)
    assert got["status"] == 0 and got["message"] == "", got
    assert got["shape"] == [3] and got["data"] is None, got
    assert out.tolist() == [n * (n + 1) / 2] * 3, out
    # allgather into memory the core owns: rank k sends k + 1 rows
    got = enqueue_cb(c.OP_ALLGATHER, "cb.gather",
                     np.full((r + 1, 2), r, np.int64))
    want = np.concatenate([np.full((k + 1, 2), k, np.int64) for k in range(n)])
    assert got["status"] == 0 and got["shape"] == list(want.shape), got
    assert (got["data"] == want).all(), got
    got = enqueue_cb(c.OP_ALLTOALL, "cb.a2a", np.arange(2.0 * n),
                     splits=[2] * n)
    assert got["splits"] == [2] * n and got["shape"] == [2 * n], got
    if n > 1:
        got = enqueue_cb(c.OP_ALLREDUCE, "cb.shape",
                         np.zeros(2 + (r == n - 1)), np.zeros(2 + (r == n - 1)))
        assert got["status"] != 0, got
        for needle in ("Mismatched shape", "'cb.shape'", "[2]", "[3]"):
            assert needle in got["message"], got
    # kerasdist_enqueue_tensors with an allocate callback, as the TF kernels
    # use it: the result lands in the caller's buffer, sized by negotiation;
    # a refused allocation fails the tensor with the caller's message.
    alloc_fn_t = ctypes.CFUNCTYPE(
        ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_char_p))

    class Tensor(ctypes.Structure):
        _fields_ = [("request", ctypes.POINTER(c._Request)),
                    ("input", ctypes.c_void_p), ("output", ctypes.c_void_p),
                    ("ready_event", ctypes.c_void_p),
                    ("allocate", alloc_fn_t), ("done", c.DONE_FN),
                    ("arg", ctypes.c_void_p)]

    lib.kerasdist_enqueue_tensors.argtypes = [
        ctypes.POINTER(Tensor), ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int32)]

    def enqueue_alloc(name, x, refuse=False):
        shape = (ctypes.c_int64 * max(x.ndim, 1))(*x.shape)
        req = c._Request(name=name.encode(), op=c.OP_ALLGATHER,
                         reduce_op=kd.Sum, dtype=c.DTYPES[x.dtype],
                         ndim=x.ndim, shape=shape, prescale=1.0,
                         postscale=1.0, group=b"", device=-1)
        got, done = {"allocs": []}, threading.Event()
        reason = ctypes.c_char_p(b"no room for it here")

        def on_alloc(arg, ndim, dims, data, message):
            got["allocs"].append([dims[i] for i in range(ndim)])
            if refuse:
                message[0] = reason
                return 4  # StatusCode kAborted
            got["out"] = np.empty(got["allocs"][-1], x.dtype)
            data[0] = got["out"].ctypes.data
            return 0

        def on_done(arg, res):
            res = res.contents
            got["status"], got["message"] = res.status, res.message.decode()
            got["data"] = res.data
            done.set()

        fns = (alloc_fn_t(on_alloc), c.DONE_FN(on_done))
        t = Tensor(ctypes.pointer(req), x.ctypes.data, None, None, *fns,
                   None)
        queued = ctypes.c_int32(-1)
        rc = lib.kerasdist_enqueue_tensors(ctypes.byref(t), 1,
                                           ctypes.byref(queued))
        assert rc == 0 and queued.value == 1, (rc, c.last_error())
        assert done.wait(60), f"{name}: no callback"
        return got

    x2 = np.full((r + 1, 2), r, np.int64)
    got = enqueue_alloc("cb.alloc", x2)
    assert got["status"] == 0 and got["allocs"] == [list(want.shape)], got
    assert got["data"] is None and (got["out"] == want).all(), got
    got = enqueue_alloc("cb.refused", x2, refuse=True)
    assert got["status"] == 4 and "no room for it here" in got["message"], got
    # refused at once, and then never called back
    err = enqueue_cb(c.OP_ALLREDUCE, "cb.bad", x, out, dtype=99)
    assert "invalid request" in err, err
    err = lib.kerasdist_enqueue_cb(None, None, None, None, c.DONE_FN(), None)
    assert err == -1 and "needs a done callback" in c.last_error()
    assert allreduce(np.ones(2), "cb.after", op=kd.Sum).tolist() == [n, n]
    print("OK callback", flush=True)
    kd.shutdown()
    err = enqueue_cb(c.OP_ALLREDUCE, "cb.late", x, out)
    assert "not initialized" in err, err

elif mode == "stall":
    # rank 0 submits a tensor the last rank never submits.
    kd.init()
    r, n = kd.rank(), kd.size()
    if r == 0:
        expect_error(lambda: allreduce(np.ones(2), "lonely.tensor"),
                     "stalled", "lonely.tensor", f"missing on rank(s) {n - 1}")
    else:
        time.sleep(6)
        # the job was failed on every rank: this rank's next collective says why
        expect_error(lambda: allreduce(np.ones(2), "late"), "stalled")
    print("OK stall", flush=True)

elif mode == "exit":
    # the last rank leaves in the middle of training; the others must not hang
    kd.init()
    r, n = kd.rank(), kd.size()
    for step in range(1000000):
        if r == n - 1 and step == 20:
            how = os.environ.get("HOW", "exit")
            if how == "kill":
                os.kill(os.getpid(), 9)
            sys.exit(0)  # a clean exit: atexit shuts kerasdist down
        allreduce(np.ones(1000), f"grad.{step % 5}", op=kd.Sum)
elif mode == "set_member_leaves":
    # np 3, set {0,1}: rank 1 leaves while rank 0 waits in a collective on
    # the set and rank 2, outside it, in one of the job's. HOW=exit:
    # os._exit (no goodbye, no MPI finalize); HOW=freeze: SIGSTOP, so only
    # the heartbeat's silence can tell; HOW=shutdown: kd.shutdown(), the
    # process staying. No one may hang: a collective that fails prints how
    # long it waited, and the rank exits 3; a rank the heartbeat ends exits
    # 75 after a line saying what it lost.
    import signal

    from kerasdist._core import capi
    SHUTDOWN_ALIVE_S = 8
    kd.init(process_sets=[kd.ProcessSet([0, 1])])
    r = kd.rank()
    assert kd.size() == 3, "run at -np 3"
    how = os.environ["HOW"]
    if r < 2:
        with capi.process_set_scope(1):
            got = allreduce(np.ones(4), "set.first", op=kd.Sum)
        assert got.tolist() == [2] * 4, got
    if r == 1:
        time.sleep(1)  # rank 0 is waiting on the set by now
        if how == "exit":
            os._exit(0)
        if how == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        kd.shutdown()
        # Alive for longer than the others may wait (the test checks their
        # times), so only the shutdown can end their waits; they wait for
        # this exit in MPI's finalize.
        time.sleep(SHUTDOWN_ALIVE_S)
        sys.exit(0)
    start = time.monotonic()
    if r == 0:
        with capi.process_set_scope(1):
            text = expect_error(
                lambda: allreduce(np.ones(4), "set.wait", op=kd.Sum),
                "rank 1")
    else:
        # rank 0 may shut down (after its error) before rank 1's goodbye
        # reached this rank: either names the rank that left.
        text = expect_error(
            lambda: allreduce(np.ones(4), "job.wait", op=kd.Sum), "shut down")
    print(f"OK set_member_leaves {time.monotonic() - start:.1f}s: {text}",
          flush=True)
    sys.exit(3)  # the job failed, as it should
else:
    sys.exit(f"unknown mode {mode}")
