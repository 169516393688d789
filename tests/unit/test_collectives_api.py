"""The public collectives are written once (the methods of
kerasdist/_public_collectives.py's `Collectives`, named by
`kerasdist.collectives.__all__`): the ones `kerasdist` routes by the Keras
backend and those of `kerasdist.tensorflow`, `kerasdist.jax` and
`kerasdist.torch` have the same signature and docstring, and each
framework's are built on its own implementation module whatever the Keras
backend."""

import ast
import importlib
import inspect
import os
import pickle
import subprocess
import sys

import pytest

import kerasdist as kd
from kerasdist import collectives
from kerasdist._public_collectives import Collectives
from tests.support.helpers import REPO_ROOT

FRAMEWORKS = ["tensorflow", "jax", "torch"]


def _module(framework):
    pytest.importorskip(framework)
    return importlib.import_module(f"kerasdist.{framework}")


@pytest.mark.parametrize("name", collectives.__all__)
def test_same_docstring_and_signature_everywhere(name):
    public = getattr(kd, name)
    assert public.__doc__ and "Args:" in public.__doc__, name
    assert "Example:" in public.__doc__, name
    for framework in FRAMEWORKS:
        f = getattr(_module(framework), name)
        assert f.__doc__ == public.__doc__, (name, framework)
        assert inspect.signature(f) == inspect.signature(public), (
            name, framework)
        # One body for every framework: the method of Collectives, bound
        # to the framework's instance.
        assert f.__name__ == name
        assert f.__qualname__ == f"Collectives.{name}"
        assert f.__func__ is getattr(Collectives, name), (name, framework)
        assert f.__self__ is collectives.bound(framework), (name, framework)


def test_each_collective_is_defined_once_as_a_method():
    # What a reader's search and an IDE follow from `kd.allreduce`: one
    # `def allreduce`, directly in `class Collectives`, nested in no
    # function (the implementation modules' functions of the same names
    # are the ops the methods call).
    defs = []
    for module in ("collectives.py", "_public_collectives.py"):
        path = os.path.join(REPO_ROOT, "kerasdist", module)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        defs += [(module, node.name, d.name) for node in ast.walk(tree)
                 if isinstance(node, (ast.Module, ast.ClassDef,
                                      ast.FunctionDef))
                 for d in node.body if isinstance(d, ast.FunctionDef)
                 and d.name in collectives.__all__]
    assert sorted(defs) == sorted(
        ("_public_collectives.py", "Collectives", name)
        for name in collectives.__all__), defs
    methods = {n for n, v in vars(Collectives).items()
               if inspect.isfunction(v) and not n.startswith("_")}
    assert methods == set(collectives.__all__)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_module_exports_every_collective(framework):
    names = set(collectives.__all__)
    assert names <= set(kd.__all__)
    assert names <= set(_module(framework).__all__)
    assert all(n in dir(kd) for n in names)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_collectives_pickle_as_the_frameworks_own(framework):
    for name in collectives.__all__:
        f = getattr(_module(framework), name)
        assert pickle.loads(pickle.dumps(f)) is f, (name, framework)


def test_import_kerasdist_reads_the_collectives_names_only():
    # kerasdist/__init__.py derives its exports from collectives.__all__
    # without loading numpy, the core library or a framework (the
    # launcher imports kerasdist).
    code = ("import sys, kerasdist; "
            "assert 'allreduce' in kerasdist.__all__; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'tensorflow', 'jax', 'torch', 'keras') "
            "or m in ('kerasdist.basics', 'kerasdist._public_collectives')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                   timeout=60)


def test_kerasdist_follows_the_keras_backend():
    framework = collectives.keras_framework()
    module = _module(framework)
    for name in collectives.__all__:
        assert getattr(kd, name) is getattr(module, name), name
        assert getattr(collectives, name) is getattr(module, name), name


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_framework_binds_its_own_implementation(framework):
    api = collectives.bound(framework)
    assert api.framework == framework
    assert api is collectives.bound(framework)  # built once
    assert _module(framework).allreduce is api.allreduce


def test_unknown_framework_and_attribute():
    with pytest.raises(ValueError, match="numpy"):
        collectives.bound("numpy")
    with pytest.raises(AttributeError, match="no attribute 'allsum'"):
        collectives.allsum  # noqa: B018
    assert sorted(dir(collectives)) == sorted(collectives.__all__)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_uninitialized_fails_clearly(framework):
    module = _module(framework)
    assert not kd.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        module.allreduce([1.0])
    with pytest.raises(RuntimeError, match="not initialized"):
        module.barrier()
