"""Saving as a Horovod user would: `kd.save_model` under `if rank() == 0`.
With a sharded optimizer it is a collective (each rank holds a shard of the
optimizer's state); called on rank 0 alone, after the other ranks are done,
it must say in one line that every rank must call it, at once, not hang or
end in the runtime's shutdown message. A real np=2 job on the JAX backend
(the cheapest to start; the gather is backend-neutral)."""

import textwrap

import pytest

from tests.support.helpers import launch
from tests.support.helpers import worker_env

pytestmark = pytest.mark.parallel

_SCRIPT = """
    import os, time
    import numpy as np, keras
    import kerasdist as kd

    kd.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=kd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), shard="optimizer_state"), loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 3)), batch_size=4, verbose=0,
              callbacks=[kd.callbacks.BroadcastGlobalVariablesCallback(0)])
    if kd.rank() == 0:  # the Horovod habit
        start = time.monotonic()
        try:
            kd.save_model(model, os.path.join({dir!r}, "model.keras"))
        except RuntimeError as e:
            print("RAISED", round(time.monotonic() - start), str(e))
"""


def test_a_sharded_save_on_rank_0_alone_says_every_rank_must_call_it(
        tmp_path):
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(dir=str(tmp_path))))
    out = launch(2, ["python", str(script)], timeout=240,
                 env=worker_env(KERAS_BACKEND="jax"))
    raised = [l for l in out.stdout.splitlines() if "RAISED" in l]
    assert len(raised) == 1, out.stdout[-3000:]
    seconds, message = raised[0].split("RAISED ", 1)[1].split(" ", 1)
    assert int(seconds) < 30, raised
    assert message.startswith(
        "kerasdist.save_model: with a sharded optimizer (shard=...) every "
        "rank must call it"), message
    assert "not under `if kd.rank() == 0`" in message, message
    assert "\n" not in message
    assert not (tmp_path / "model.keras").exists()
