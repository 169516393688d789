"""Cheaper rank starts in the test suite: Keras and TensorFlow import some
packages only because they are installed, and no test rank uses them.

tests/conftest.py puts this folder first on PYTHONPATH for every process
the tests start (ranks, launchers, workers), so Python imports this module
at start-up (`sitecustomize`). It refuses the imports in _OPPORTUNISTIC
when they come from the named importers, which catch the ImportError and
go on without them, as on a machine where the package is not installed:

- pandas (Keras' array slicing, 0.4-1 s), scikit-learn (Keras' sklearn
  wrappers, 1.1 s) and matplotlib (Keras' image gallery, 0.1-0.2 s), from
  Keras and TensorFlow;
- JAX (0.5-2 s) from TensorFlow's tf.lite and from Keras' Orbax callback,
  which import it on every backend.

Every other importer gets them as usual: a rank script, kerasdist itself
(kerasdist.autotune's scikit-learn), Keras on the JAX backend (its backend
module imports JAX before anything here could refuse it). Set
KERASDIST_TEST_IMPORT_GUARD=0 to start ranks with everything Keras finds.

With KERASDIST_TEST_CPU_LOG=FILE, every such process that exits normally
appends one JSON line to FILE: its command, the test that started it
(PYTEST_CURRENT_TEST), its CPU seconds and which frameworks it imported;
tools/cpu_by_test.py sums them, to find where the suite's CPU goes.
Standard library only.
"""

import os
import sys

# Top-level package: the importers (module names or prefixes ending in ".")
# it is refused to.
_OPPORTUNISTIC = {
    "pandas": ("keras.", "tensorflow."),
    "sklearn": ("keras.", "tensorflow."),
    "matplotlib": ("keras.", "tensorflow."),
    "jax": ("tensorflow.lite.", "keras.src.callbacks.orbax_checkpoint"),
}


def _importer():
    """The name of the module whose code runs the import in progress."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("importlib") and name != __name__:
            return name
        frame = frame.f_back
    return ""


def _refused(importer, prefixes):
    return any(importer == p or (p.endswith(".") and importer.startswith(p))
               for p in prefixes)


class _OpportunisticImports:
    """A meta path finder that refuses _OPPORTUNISTIC's imports."""

    def find_spec(self, name, path=None, target=None):
        prefixes = _OPPORTUNISTIC.get(name)
        if prefixes and _refused(_importer(), prefixes):
            raise ModuleNotFoundError(
                f"No module named {name!r} (left out of test ranks: "
                "tests/support/rank_site/sitecustomize.py)", name=name)
        return None


def _log_cpu(path):
    import json
    import resource
    import time
    start = time.monotonic()

    def write():
        use = resource.getrusage(resource.RUSAGE_SELF)
        line = json.dumps({
            "argv": [os.path.basename(a) for a in sys.argv[:3]],
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "cpu": round(use.ru_utime + use.ru_stime, 2),
            "wall": round(time.monotonic() - start, 2),
            "mods": [m for m in ("tensorflow", "jax", "torch", "keras")
                     if m in sys.modules]})
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass

    import atexit
    atexit.register(write)


if os.environ.get("KERASDIST_TEST_IMPORT_GUARD", "1") != "0":
    sys.meta_path.insert(0, _OpportunisticImports())
if os.environ.get("KERASDIST_TEST_CPU_LOG"):
    _log_cpu(os.environ["KERASDIST_TEST_CPU_LOG"])
