"""A TensorFlow gradient's walk from `model.fit` to the op, followed as an
editor follows it: each hop is a call that a static analyser (jedi, as in
tests/unit/test_api_names.py) takes to the code that runs, with no
importlib lookup on the way and no call back into the optimizer.

    keras/optimizer.py      ReplicatedStep.apply -> _kerasdist_reduce
                            -> _kerasdist_reduce_all -> reduction
    keras/reduction.py      reduce_gradients -> plan, execute ->
                            framework.collectives.grouped_allreduce
    tensorflow/_keras_layer.py  the TF hook object's `collectives`: the
                            module kerasdist/tensorflow/collectives.py
    tensorflow/collectives.py   grouped_allreduce (the TF op)

`framework` is the running backend's hook object, chosen once
(`kerasdist.keras.framework.get()`); the hop through it is checked on the
TensorFlow object itself, `FRAMEWORK.collectives.grouped_allreduce`."""

import ast
import os

import jedi
import pytest

from tests.support.helpers import REPO_ROOT
from tests.support.static_analysis import ENVIRONMENT
from tests.support.static_analysis import static_analysis_sees_every_module  # noqa: F401 (a fixture)

# The sources only, analysed in this process (see test_api_names.py).
PROJECT = jedi.Project(REPO_ROOT, sys_path=[REPO_ROOT], smart_sys_path=False)

# (file, function (Class.method), the call in it, where it must lead).
HOPS = [
    ("kerasdist/keras/optimizer.py", "ReplicatedStep.apply",
     "self._kerasdist_reduce(",
     ("kerasdist/keras/optimizer.py", "_kerasdist_reduce")),
    ("kerasdist/keras/optimizer.py", "ReplicatedStep._kerasdist_reduce",
     "self._kerasdist_reduce_all(",
     ("kerasdist/keras/optimizer.py", "_kerasdist_reduce_all")),
    ("kerasdist/keras/optimizer.py", "ReplicatedStep._kerasdist_reduce_all",
     "_reduction.reduce_gradients(",
     ("kerasdist/keras/reduction.py", "reduce_gradients")),
    ("kerasdist/keras/reduction.py", "reduce_gradients", "execute(",
     ("kerasdist/keras/reduction.py", "execute")),
]
# The modules the walk passes through.
WALK = ["kerasdist/keras/optimizer.py", "kerasdist/keras/reduction.py",
        "kerasdist/tensorflow/_keras_layer.py",
        "kerasdist/tensorflow/collectives.py"]


def _source(path):
    with open(os.path.join(REPO_ROOT, path)) as f:
        return f.read()


def _function(tree, qualname):
    """The def of `qualname` ("f" or "Class.method") in `tree`."""
    node = tree
    for part in qualname.split("."):
        node = next(n for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                    and n.name == part)
    return node


def _goto(path, source, line, column):
    script = jedi.Script(source, path=os.path.join(REPO_ROOT, path),
                         project=PROJECT, environment=ENVIRONMENT)
    return [(os.path.relpath(str(d.module_path), REPO_ROOT), d.name)
            for d in script.goto(line, column, follow_imports=True)]


@pytest.mark.parametrize("path,function,call,target", HOPS,
                         ids=[f"{h[1]}->{h[3][1]}" for h in HOPS])
def test_each_hop_of_the_walk_is_followable(path, function, call, target):
    source = _source(path)
    node = _function(ast.parse(source), function)
    lines = source.splitlines()
    for lineno in range(node.lineno, node.end_lineno + 1):
        column = lines[lineno - 1].find(call)
        if column >= 0:
            break
    else:
        raise AssertionError(f"{path}: {function} no longer calls {call}")
    # On the called name (the last dotted part, before the parenthesis).
    column += len(call) - 2
    found = _goto(path, source, lineno, column)
    assert target in found, f"{path}:{lineno} {call} -> {found}"


def test_the_reduction_calls_the_frameworks_grouped_allreduce():
    tree = ast.parse(_source("kerasdist/keras/reduction.py"))
    calls = [ast.unparse(n.func) for n in ast.walk(_function(tree, "execute"))
             if isinstance(n, ast.Call)]
    assert "framework.collectives.grouped_allreduce" in calls, calls


def test_the_tensorflow_hook_names_its_collectives_module():
    # What `framework.collectives.grouped_allreduce` is on TensorFlow.
    source = ("from kerasdist.tensorflow._keras_layer import FRAMEWORK\n"
              "FRAMEWORK.collectives.grouped_allreduce\n")
    found = _goto("use.py", source, 2, len("FRAMEWORK.collectives.") + 1)
    assert ("kerasdist/tensorflow/collectives.py",
            "grouped_allreduce") in found, found


def test_no_importlib_and_no_double_back_on_the_walk():
    wrong = []
    for path in WALK:
        tree = ast.parse(_source(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            wrong += [f"{path} imports {n}" for n in names
                      if n.split(".")[0] == "importlib"]
            if path != "kerasdist/keras/optimizer.py":
                wrong += [f"{path} imports {n}" for n in names
                          if n.startswith("kerasdist.keras.optimizer")
                          or n.startswith("kerasdist.keras.distributed_")]
            if isinstance(node, ast.ImportFrom) and \
                    node.module == "kerasdist.keras" and \
                    path != "kerasdist/keras/optimizer.py":
                wrong += [f"{path} imports kerasdist.keras.{a.name}"
                          for a in node.names
                          if a.name in ("optimizer", "distributed_optimizer")]
    assert not wrong, wrong
