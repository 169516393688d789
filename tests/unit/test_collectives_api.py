"""The public collectives are written once (kerasdist/collectives.py): the
ones `kerasdist` routes by the Keras backend and those of
`kerasdist.tensorflow`, `kerasdist.jax` and `kerasdist.torch` have the same
signature and docstring, and each framework's are built on its own
implementation module whatever the Keras backend."""

import importlib
import inspect

import pytest

import kerasdist as kd
from kerasdist import collectives

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
        assert f.__name__ == f.__qualname__ == name


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
