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
module imports JAX before anything here could refuse it).

TensorFlow (3-4 CPU s) is imported by Keras on every backend when it asks
`keras.src.utils.module_utils.tensorflow.available`: to tell whether an
object it serializes is a TensorFlow one (model.save, an optimizer's
config), and in keras.utils.set_random_seed, to seed TensorFlow too. While
TensorFlow is not imported, those askers get False (not cached): no object
can be a TensorFlow one then, and the seed is kept and given to
tf.random.set_seed right after TensorFlow's import, before anything can use
it (_TF_ISINSTANCE_ASKERS, _SEED_ASKER). Any other asker, and every asker
once TensorFlow is imported, gets Keras' own answer. Set
KERASDIST_TEST_IMPORT_GUARD=0 to start ranks with everything Keras finds,
and none of this.

With KERASDIST_TEST_IMPORT_TRACE=MODULE=FILE, every process appends to FILE
the stack of its first import of MODULE (`tensorflow=/tmp/tf.txt`: who
imports TensorFlow in a JAX job).

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


# Keras asks `module_utils.tensorflow.available` (which imports TensorFlow,
# 3-4 CPU s, to answer) on every backend, here only to test whether an
# object is a TensorFlow one, which it cannot be while TensorFlow is not
# imported: the answer is False then (not cached, so a later question after
# TensorFlow's import gets True, as before).
_TF_ISINSTANCE_ASKERS = {
    ("keras.src.saving.serialization_lib", "serialize_keras_object"),
    ("keras.src.legacy.saving.json_utils", "get_json_type"),
    ("keras.src.legacy.saving.json_utils", "default"),
}
# And set_random_seed, to seed TensorFlow too: while TensorFlow is not
# imported its seed is kept, and set (tf.random.set_seed) as soon as
# TensorFlow is imported, before anything can use it.
_SEED_ASKER = ("keras.src.utils.rng_utils", "set_random_seed")
_pending_tf_seed = []


def _asker():
    """(module, function) of the code that asks the property in progress,
    and its frame."""
    frame = sys._getframe(2)
    return (frame.f_globals.get("__name__", ""), frame.f_code.co_name), frame


def _tensorflow_if_imported(module_utils):
    """Makes module_utils.tensorflow.available answer False, uncached, to
    the askers above while TensorFlow is not imported."""
    lazy = module_utils.tensorflow
    base = type(lazy)

    class TensorflowIfImported(base):
        @property
        def available(self):
            if self._available is None and "tensorflow" not in sys.modules:
                asker, frame = _asker()
                if asker in _TF_ISINSTANCE_ASKERS:
                    return False
                if asker == _SEED_ASKER and "seed" in frame.f_locals:
                    _pending_tf_seed[:] = [frame.f_locals["seed"]]
                    return False
            return base.available.fget(self)

    lazy.__class__ = TensorflowIfImported


def _seed_tensorflow(tf):
    if _pending_tf_seed:
        tf.random.set_seed(_pending_tf_seed.pop())


class _AfterImport:
    """A meta path finder that calls `then[name](module)` right after module
    `name` has run (its first import), before its importer goes on."""

    def __init__(self, then):
        self.then = then

    def find_spec(self, name, path=None, target=None):
        fn = self.then.get(name)
        if fn is None or name in sys.modules:
            return None
        mine = sys.meta_path.index(self)
        for finder in sys.meta_path[mine + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenLoader(spec.loader, fn)
        return spec


class _ThenLoader:
    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # The module keeps its own loader, as without this.
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


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


class _TraceImport:
    """A meta path finder that appends, to a file, the stack of the first
    real import of a module (importlib.util.find_spec, which torch's
    dynamo calls for "tensorflow", is not one)."""

    def __init__(self, name, path):
        self.name, self.path = name, path

    def find_spec(self, name, path=None, target=None):
        if name != self.name or name in sys.modules:
            return None
        caller = sys._getframe(1).f_back  # of importlib's _find_spec
        if caller is None or caller.f_code.co_name != \
                "_find_and_load_unlocked":
            return None
        sys.meta_path.remove(self)
        import traceback
        stack = "".join(traceback.format_stack(sys._getframe(1)))
        with open(self.path, "a") as f:
            f.write(f"=== {name} imported by {sys.argv[:3]} in "
                    f"{os.environ.get('PYTEST_CURRENT_TEST', '')}\n"
                    f"{stack}\n")
        return None


if os.environ.get("KERASDIST_TEST_IMPORT_GUARD", "1") != "0":
    sys.meta_path.insert(0, _OpportunisticImports())
    sys.meta_path.insert(0, _AfterImport({
        "keras.src.utils.module_utils": _tensorflow_if_imported,
        "tensorflow": _seed_tensorflow}))
if os.environ.get("KERASDIST_TEST_IMPORT_TRACE"):
    _name, _, _path = os.environ["KERASDIST_TEST_IMPORT_TRACE"].partition(
        "=")
    sys.meta_path.insert(0, _TraceImport(_name, _path))
if os.environ.get("KERASDIST_TEST_CPU_LOG"):
    _log_cpu(os.environ["KERASDIST_TEST_CPU_LOG"])
