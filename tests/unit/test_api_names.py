"""The public names of every namespace are visible without running
kerasdist: the blocks tools/api_names.py writes from the one list are
current, and a static analyser (jedi, as editors use it) follows each
name of `kerasdist`, `kerasdist.collectives` and the three framework
packages to the code that runs: a collective to its method of
`Collectives`, a process-API name to the module that defines it."""

import importlib.util
import os

import jedi
import pytest

from tests.support.helpers import REPO_ROOT
from tests.support.static_analysis import ENVIRONMENT
from tests.support.static_analysis import static_analysis_sees_every_module  # noqa: F401 (a fixture)


def _tool():
    spec = importlib.util.spec_from_file_location(
        "api_names", os.path.join(REPO_ROOT, "tools", "api_names.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


API_NAMES = _tool()
NAMESPACES = ["kerasdist", "kerasdist.collectives", "kerasdist.tensorflow",
              "kerasdist.jax", "kerasdist.torch"]


def test_api_names_blocks_are_current():
    assert API_NAMES.stale() == [], (
        "run python tools/api_names.py and commit what it writes")


def test_api_names_check_finds_a_stale_block(tmp_path):
    # The check would notice a name missing from a namespace.
    path = "kerasdist/jax/__init__.py"
    with open(os.path.join(REPO_ROOT, path)) as f:
        text = f.read()
    dropped = text.replace("allreduce = _api.allreduce\n", "")
    assert dropped != text
    assert API_NAMES.rewritten(dropped, API_NAMES.blocks()[path],
                               path) == text


def _expected(namespace):
    """{public name: (file, name of the def it must lead to)}."""
    collectives = API_NAMES.collectives()
    out = {name: ("kerasdist/_public_collectives.py", name)
           for name in collectives}
    if namespace == "kerasdist.collectives":
        return out
    for name, module in API_NAMES.process_api().items():
        out[name] = (f"kerasdist/{module.replace('.', '/')}.py", name)
    return out


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_api_names_editor_follows_each_name(namespace):
    # The sources only (not what a test's environment puts on sys.path),
    # analysed in this process (jedi would otherwise start a helper).
    project = jedi.Project(REPO_ROOT, sys_path=[REPO_ROOT],
                           smart_sys_path=False)
    missing = []
    for name, (path, definition) in sorted(_expected(namespace).items()):
        source = f"import {namespace} as kd\nkd.{name}"
        script = jedi.Script(source, path=os.path.join(REPO_ROOT, "use.py"),
                             project=project, environment=ENVIRONMENT)
        # What the name is (a function, a class), else where it is set
        # (a constant such as `Average`).
        found = [(os.path.relpath(str(d.module_path), REPO_ROOT), d.name)
                 for d in script.infer(2, len("kd.") + 1)
                 + script.goto(2, len("kd.") + 1, follow_imports=True)]
        if (path, definition) not in found:
            missing.append(f"{namespace}.{name} -> {found}")
    assert not missing, (
        "names a static analyser cannot follow to their code:\n"
        + "\n".join(missing))
