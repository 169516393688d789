"""The suite's own start-up savings behave as what they stand in for:
tests/support/rank_site/sitecustomize.py (Keras' TensorFlow questions on
other backends) and tests/support/forkserver.py (ranks forked from a
server)."""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from tests.support import forkserver
from tests.support.helpers import REPO_ROOT

# On JAX: set_random_seed and an optimizer's config (what model.save and
# DistributedOptimizer serialize), then TensorFlow imported and used.
_SEEDED = """
import sys
import keras
keras.utils.set_random_seed(42)
keras.utils.set_random_seed(7)
config = keras.saving.serialize_keras_object(
    keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
print("tensorflow" in sys.modules, config["class_name"])
import tensorflow as tf
order = list(tf.data.Dataset.range(8).shuffle(8).as_numpy_iterator())
print([int(i) for i in order], tf.random.uniform([2]).numpy().tolist())
print(keras.src.utils.module_utils.tensorflow.available)
"""


def _python(code, **env):
    full = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
                **env)
    out = subprocess.run([sys.executable, "-c", code], env=full, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_keras_asks_for_tensorflow_only_once_it_is_imported():
    for module in ("jax", "tensorflow"):  # not imported here
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    guarded = _python(_SEEDED)
    plain = _python(_SEEDED, KERASDIST_TEST_IMPORT_GUARD="0")
    # Without the guard Keras imports TensorFlow to answer; with it, not
    # before the script does, and the seed and config come out the same.
    assert guarded[0] == "False LossScaleOptimizer", guarded
    assert plain[0] == "True LossScaleOptimizer", plain
    assert guarded[1:] == plain[1:] and guarded[2] == "True", (guarded,
                                                              plain)


_RANK = """
import os, signal, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "x", os.environ.get("X"),
      flush=True)
how = sys.argv[1]
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "raise":
    raise RuntimeError("injected")
sys.exit(int(how))
"""


def test_forkserver_rank_ends_as_its_forked_child(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    name = f"unit{os.getpid()}"

    def rank(how):
        return subprocess.run(
            forkserver.command(name, str(script), how), cwd=tmp_path,
            env=dict(os.environ, X=how), capture_output=True, text=True,
            timeout=60)

    with forkserver.Servers(name, ["json"], dict(os.environ)):
        out = rank("3")
        assert out.returncode == 3, out
        assert out.stdout == f"argv ['3'] cwd {tmp_path} x 3\n", out
        out = rank("kill")
        assert out.returncode == -signal.SIGKILL, out
        out = rank("raise")
        assert out.returncode == 1, out
        assert "RuntimeError: injected" in out.stderr, out
    out = rank("0")
    assert out.returncode == 1 and "no server" in out.stderr, out
