"""How kerasdist's Python modules may use each other, checked on their
source with `ast` (nothing is imported):

- the imports between kerasdist modules form no cycle (counting imports
  inside functions, which would otherwise hide one);
- no module reaches into another kerasdist module's private names
  (`basics._OP_NAMES`), nor into private attributes that another module's
  class sets on itself (`trainer._phase` read outside the Trainer);
- nothing looks modules up in `sys.modules` to dodge an import;
- the launcher (`kerasdist.run`) uses only itself, the ctypes binding,
  the MPI build record (`_core.site_mpi`) and the rendezvous, `autotune`
  only the ctypes binding, and only the command-line tools import the
  launcher;
- the rendezvous (`kerasdist.rendezvous`: launch conventions, the server
  and its client, the start's watch) imports no kerasdist module outside
  itself, and both `kd.init()` (`basics`) and the launcher use it.
"""

import ast
import os

from tests.support.helpers import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "kerasdist")
# Command-line front ends that may start or describe the launcher.
_LAUNCHER_USERS = {"kerasdist.tools.cli", "kerasdist.tools.doctor",
                   "kerasdist.tools.settings_doc"}
# What kd.init() runs before MPI starts besides the rendezvous (site_mpi:
# whether the launcher suits the MPI built against), which the launcher
# shares: imports no kerasdist module.
_SITE_MPI = "kerasdist._core.site_mpi"
_RENDEZVOUS = "kerasdist.rendezvous"


def _modules():
    """{module name: parsed tree} for every .py file of the package."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
            module = rel[:-len(".__init__")] if rel.endswith(
                ".__init__") else rel
            with open(path) as f:
                out[module] = ast.parse(f.read(), path)
    return out


MODULES = _modules()


def _imports(module, tree):
    """{local alias: kerasdist module} and the set of kerasdist modules
    `module` imports (anywhere in the file), plus names imported `from` a
    module: {alias: (module, name)}."""
    aliases, targets, names = {}, set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kerasdist":
                    targets.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "kerasdist":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in MODULES:
                    targets.add(full)
                    aliases[a.asname or a.name] = full
                else:
                    targets.add(node.module)
                    names[a.asname or a.name] = (node.module, a.name)
    targets.discard(module)
    return aliases, {t for t in targets if t in MODULES}, names


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def test_no_import_cycles():
    graph = {m: _imports(m, t)[1] for m, t in MODULES.items()}
    # Importing a submodule imports its package first; that is no cycle.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycle = path[path.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_private_names_of_other_modules():
    bad = []
    for module, tree in MODULES.items():
        aliases, _, names = _imports(module, tree)
        for alias, (source, name) in names.items():
            if _private(name) and source != module:
                bad.append(f"{module}: from {source} import {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and \
                    isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and \
                    f"{aliases[node.value.id]}.{node.attr}" not in MODULES:
                bad.append(f"{module}:{node.lineno}: "
                           f"{node.value.id}.{node.attr}")
    assert not bad, "private names used across modules: " + ", ".join(bad)


def _own_private_attributes(tree):
    """Private attributes a module's classes set on `self`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and \
                isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
    return out


def test_no_private_attributes_of_other_modules_objects():
    owners = {m: _own_private_attributes(t) for m, t in MODULES.items()}
    bad = []
    for module, tree in MODULES.items():
        foreign = set().union(*(a for m, a in owners.items() if m != module))
        foreign -= owners[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in foreign and \
                    isinstance(node.value, ast.Name) and \
                    node.value.id not in ("self", "cls"):
                bad.append(f"{module}:{node.lineno}: "
                           f"{node.value.id}.{node.attr}")
    assert not bad, ("another module's private attributes: "
                     + ", ".join(bad))


def test_no_sys_modules_lookups():
    bad = [m for m, t in MODULES.items() for node in ast.walk(t)
           if isinstance(node, ast.Attribute) and node.attr == "modules"
           and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not bad, bad


def test_layers():
    deps = {m: _imports(m, t)[1] for m, t in MODULES.items()}
    binding = {"kerasdist._core.capi", "kerasdist"}

    def within(m, package):
        return m == package or m.startswith(package + ".")

    for m, targets in deps.items():
        if within(m, "kerasdist.run"):
            outside = {t for t in targets
                       if not within(t, "kerasdist.run")
                       and not within(t, _RENDEZVOUS)} - binding - {_SITE_MPI}
            assert not outside, f"the launcher {m} imports {outside}"
        elif m not in _LAUNCHER_USERS:
            launcher = {t for t in targets if within(t, "kerasdist.run")}
            assert not launcher, f"{m} imports the launcher: {launcher}"
        if within(m, _RENDEZVOUS):
            outside = {t for t in targets if not within(t, _RENDEZVOUS)}
            assert not outside, f"the rendezvous {m} imports {outside}"
    assert not deps[_SITE_MPI], deps[_SITE_MPI]
    for user in ("kerasdist.basics", "kerasdist.run.launch"):
        assert any(within(t, _RENDEZVOUS) for t in deps[user]), user
    assert _SITE_MPI in deps["kerasdist.basics"]
    assert deps["kerasdist.autotune"] <= binding, deps["kerasdist.autotune"]
    assert "kerasdist.autotune" in deps["kerasdist.basics"]


def test_the_rendezvous_imports_no_framework():
    """Beside the standard library it imports only torch's TCPStore, where
    torchrun's agent serves the coordinator's port (client.py)."""
    wrong = []
    for module, tree in MODULES.items():
        if not module.startswith(_RENDEZVOUS + "."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            wrong += [f"{module} imports {n}" for n in names
                      if n.split(".")[0] in ("keras", "tensorflow", "jax",
                                             "numpy")
                      or n.split(".")[0] == "torch"
                      and n != "torch.distributed"]
    assert not wrong, wrong


# The Keras layer's framework-neutral modules: they reach a framework only
# through kerasdist.keras.framework.get(), which returns the running
# backend's object from kerasdist/<framework>/_keras_layer.py.
_NEUTRAL = ("kerasdist.keras.optimizer", "kerasdist.keras.reduction",
            "kerasdist.keras.distributed_optimizer",
            "kerasdist.keras.framework", "kerasdist.keras.sharding.layout",
            "kerasdist.keras.sharding.step",
            "kerasdist.keras.sharding.optimizer",
            "kerasdist.keras.sharding.files",
            "kerasdist.keras.sync_batch_norm",
            "kerasdist.util", "kerasdist.callbacks.broadcast",
            "kerasdist.callbacks.model_average", "kerasdist.callbacks._util")
_FRAMEWORK_NAMES = {"tensorflow", "jax", "torch"}


def test_the_keras_layer_never_asks_which_framework_runs():
    wrong = []
    for module in _NEUTRAL:
        _, targets, _ = _imports(module, MODULES[module])
        for node in ast.walk(MODULES[module]):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = []
            wrong += [f"{module} imports {n}" for n in names
                      if n.split(".")[0] in _FRAMEWORK_NAMES]
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    if isinstance(side, ast.Constant) and \
                            side.value in _FRAMEWORK_NAMES:
                        wrong.append(f"{module}:{node.lineno} compares with "
                                     f"{side.value!r}")
        wrong += [f"{module} imports {t}" for t in targets
                  if t.split(".")[1] in _FRAMEWORK_NAMES]
    assert not wrong, wrong


# The public namespaces: the only modules that bind the public collectives.
_NAMESPACES = {"kerasdist", "kerasdist.collectives", "kerasdist.tensorflow",
               "kerasdist.jax", "kerasdist.torch"}


def test_the_keras_layer_goes_straight_to_its_framework():
    """From model.fit to the op a gradient passes the neutral modules
    (optimizer, _gradient_reduction), then its framework's package
    (`_keras_layer`, `collectives`), and never comes back: the Keras layer
    calls the framework's collectives module, not the public collectives
    (`kerasdist._public_collectives`, `kerasdist.collectives.bound`),
    which are neutral code again. Only the public namespaces use those."""
    wrong = []
    for module, tree in MODULES.items():
        if module in _NAMESPACES or module == "kerasdist._public_collectives":
            continue
        aliases, targets, names = _imports(module, tree)
        if "kerasdist._public_collectives" in targets:
            wrong.append(f"{module} imports kerasdist._public_collectives")
        wrong += [f"{module} imports bound from kerasdist.collectives"
                  for source, name in names.values()
                  if (source, name) == ("kerasdist.collectives", "bound")]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "bound" and \
                    isinstance(node.value, ast.Name) and \
                    aliases.get(node.value.id) == "kerasdist.collectives":
                wrong.append(f"{module}:{node.lineno} calls "
                             "kerasdist.collectives.bound")
    assert not wrong, wrong
