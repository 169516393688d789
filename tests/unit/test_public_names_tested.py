"""Every public name of kerasdist has a test whose name says it.

The names: kerasdist.__all__, kerasdist.callbacks.__all__, the public
functions and classes of kerasdist.data and kerasdist.schedules, and
kerasdist.jax / kerasdist.torch __all__ (submodules and dunders aside).
A name counts as tested when its snake_case form (EqualizeStepsCallback:
equalize_steps_callback, or without the _callback suffix, equalize_steps)
appears, as whole _-separated words, in the name of a test function under
tests/ or of a worker check (tests/support/checks.py). Read from the
sources with ast: nothing is run.
"""

import ast
import importlib
import importlib.util
import os
import re

from tests.support import checks
from tests.support.helpers import REPO_ROOT
from tests.support.helpers import WORKERS

TESTS = os.path.join(REPO_ROOT, "tests")

# name -> why it has no test named after it. Keep this empty or tiny.
EXCEPTIONS = {}


def _snake(name):
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return s.lower()


def _forms(name):
    snake = _snake(name)
    forms = [snake]
    if snake.endswith("_callback") and snake != "_callback":
        forms.append(snake[:-len("_callback")])
    return forms


def _names(value, tree):
    """The names of an `__all__` expression: a list, the sorted keys of a
    dict literal of the module, or lists and other kerasdist modules'
    `__all__` (`[...] + _collectives.__all__`, the alias imported `from
    kerasdist import collectives as _collectives`), added; None for
    anything else."""
    if isinstance(value, (ast.List, ast.Tuple)):
        return [ast.literal_eval(e) for e in value.elts]
    if (isinstance(value, ast.Call) and getattr(value.func, "id", None)
            in ("sorted", "list") and len(value.args) == 1
            and isinstance(value.args[0], ast.Name)):
        # sorted(TABLE): the keys of the module's dict literal TABLE.
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None)
                    == value.args[0].id and isinstance(node.value, ast.Dict)):
                keys = node.value.keys  # None for a `**` entry
                return (None if None in keys
                        else [ast.literal_eval(k) for k in keys])
        return None
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        left, right = _names(value.left, tree), _names(value.right, tree)
        return None if left is None or right is None else left + right
    if (isinstance(value, ast.Attribute) and value.attr == "__all__"
            and isinstance(value.value, ast.Name)):
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] == "kerasdist":
                for a in node.names:
                    if (a.asname or a.name) == value.value.id:
                        return _all(f"{node.module}.{a.name}")
    return None


def _all(module_name):
    """The module's `__all__`, read from its source; None without one."""
    spec = importlib.util.find_spec(module_name)
    with open(spec.origin) as f:
        tree = ast.parse(f.read(), spec.origin)
    names = None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "__all__"):
            names = _names(node.value, tree)
    return names


def _public(module_name):
    """The module's public names, read from its source (kerasdist's own
    __all__ from the module, which imports nothing on its own)."""
    spec = importlib.util.find_spec(module_name)
    with open(spec.origin) as f:
        tree = ast.parse(f.read(), spec.origin)
    names = _all(module_name)
    if names is None and module_name == "kerasdist":
        names = importlib.import_module(module_name).__all__
    if names is None:
        names = [n.name for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                 and not n.name.startswith("_")]
    package = os.path.dirname(spec.origin)
    is_package = os.path.basename(spec.origin) == "__init__.py"
    return [n for n in names if not n.startswith("__") and not (
        is_package and (os.path.exists(os.path.join(package, f"{n}.py"))
                        or os.path.isdir(os.path.join(package, n))))]


def _test_names():
    names = set()
    for root, _, files in os.walk(TESTS):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            if os.path.dirname(path) == WORKERS:
                names.update(n for n, _ in checks.check_names(path))
                continue
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            names.update(node.name for node in ast.walk(tree)
                         if isinstance(node, (ast.FunctionDef,
                                              ast.AsyncFunctionDef))
                         and node.name.startswith("test_"))
    return names


def _says(test_name, form):
    words, want = test_name.lower().split("_"), form.split("_")
    return any(words[i:i + len(want)] == want
               for i in range(len(words) - len(want) + 1))


MODULES = ["kerasdist", "kerasdist.callbacks", "kerasdist.data",
           "kerasdist.schedules", "kerasdist.jax", "kerasdist.torch"]


def test_public_names_tested_by_name():
    tests = _test_names()
    assert len(tests) > 100, sorted(tests)  # the walk found the suite
    missing = {}
    for module in MODULES:
        for name in _public(module):
            if name in EXCEPTIONS:
                continue
            if not any(_says(t, f) for t in tests for f in _forms(name)):
                missing.setdefault(module, []).append(
                    " or ".join(_forms(name)))
    assert not missing, (
        "public names with no test (function or worker check) whose name "
        f"says them: {missing}")


def test_exceptions_are_still_public():
    public = {n for m in MODULES for n in _public(m)}
    assert set(EXCEPTIONS) <= public, set(EXCEPTIONS) - public
