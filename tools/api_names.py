"""Writes the public names of kerasdist's namespaces into their modules as
plain imports and assignments, so that a reader, an IDE or a type checker
follows `kd.allreduce` to its code (`Collectives.allreduce` in
kerasdist/_public_collectives.py) as Keras' generated API files do.

The one list is kerasdist/_core/process_api.py's `PROCESS_API` (the process
API), kerasdist/collectives.py's `__all__` (the collectives) and
kerasdist/__init__.py's `_EXPORTS`; each namespace's block below is made
from them:

- kerasdist/{tensorflow,jax,torch}/__init__.py: the process API imported,
  and each collective bound to the framework (what runs);
- kerasdist/__init__.py and kerasdist/collectives.py: the same under
  `if TYPE_CHECKING:` (at run time they load names on first use, so that
  `import kerasdist` stays light).

    python tools/api_names.py          # rewrite the blocks
    python tools/api_names.py --check  # exit 1 where a block is stale

tests/unit/test_api_names.py runs the check.
"""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = "# ---- names written by tools/api_names.py from the one list"
END = "# ---- end of the names written by tools/api_names.py"
FRAMEWORKS = ("tensorflow", "jax", "torch")
# A framework package's own names beside the process API and collectives.
OWN = {"tensorflow": {"DistributedGradientTape": "tensorflow.tape",
                      "PartialDistributedGradientTape": "tensorflow.tape"}}


def _literal(path, name):
    """The value of the module-level assignment `name = <literal>` in
    `path` (read with ast: nothing is imported)."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name
                for t in node.targets):
            return _evaluate(node.value)
    raise LookupError(f"{path} has no `{name} = ...`")


def _evaluate(node):
    """A literal, where dicts may unpack others (`**PROCESS_API`) and
    `dict.fromkeys(COLLECTIVES, "collectives")` names the collectives."""
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                out.update(_evaluate(value))
            else:
                out[ast.literal_eval(key)] = ast.literal_eval(value)
        return out
    if isinstance(node, ast.Attribute) and node.attr == "PROCESS_API":
        return process_api()
    if isinstance(node, ast.Call) and getattr(node.func, "attr",
                                              None) == "fromkeys":
        return dict.fromkeys(collectives(),
                             ast.literal_eval(node.args[1]))
    return ast.literal_eval(node)


def process_api():
    return _literal("kerasdist/_core/process_api.py", "PROCESS_API")


def collectives():
    return _literal("kerasdist/collectives.py", "__all__")


def _imports(exports, indent=""):
    # In any order: ruff sorts and wraps them (`formatted`).
    return [f"{indent}from kerasdist.{module} import {name} as {name}"
            for name, module in sorted(exports.items())]


def framework_block(framework):
    lines = _imports({**process_api(), **OWN.get(framework, {})})
    lines.append("")
    lines.append(f'_api = _collectives.bound("{framework}")')
    lines += [f"{name} = _api.{name}" for name in collectives()]
    return lines


def collectives_block():
    lines = ["if TYPE_CHECKING:",
             "    # What `__getattr__` returns: the Keras backend's."
             ]
    lines.append("    _api = bound(keras_framework())")
    lines += [f"    {name} = _api.{name}" for name in collectives()]
    return lines


def package_block():
    # The public names (its submodules an analyser finds by itself).
    exports = {name: module for name, module in
               _literal("kerasdist/__init__.py", "_EXPORTS").items()
               if not name.startswith("_")}
    return ["if TYPE_CHECKING:"] + _imports(exports, indent="    ")


def blocks():
    """{path: the lines between BEGIN and END}."""
    out = {f"kerasdist/{fw}/__init__.py": framework_block(fw)
           for fw in FRAMEWORKS}
    out["kerasdist/collectives.py"] = collectives_block()
    out["kerasdist/__init__.py"] = package_block()
    return out


def rewritten(text, lines, path):
    """`text` with its block replaced by `lines`, its imports sorted and
    wrapped as ruff's lint (`I`) wants them."""
    try:
        head, rest = text.split(BEGIN + "\n", 1)
        _, tail = rest.split(END + "\n", 1)
    except ValueError:
        raise ValueError(f"{path}: no block between {BEGIN!r} and "
                         f"{END!r}") from None
    return formatted(
        head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + "\n" + tail,
        path)


def formatted(text, path):
    """`text` with ruff's import fixes applied (the project's settings)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--fix", "--select", "I",
         "--quiet", "--exit-zero", "--stdin-filename",
         os.path.join(ROOT, path), "-"],
        input=text, capture_output=True, text=True, cwd=ROOT, check=True)
    return done.stdout


def stale():
    """The paths whose block is not what the list makes."""
    out = []
    for path, lines in blocks().items():
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        if rewritten(text, lines, path) != text:
            out.append(path)
    return out


def main(argv):
    if argv[1:] == ["--check"]:
        paths = stale()
        for path in paths:
            print(f"{path}: its public names are stale; run "
                  "python tools/api_names.py")
        return 1 if paths else 0
    for path, lines in blocks().items():
        full = os.path.join(ROOT, path)
        with open(full) as f:
            text = f.read()
        new = rewritten(text, lines, path)
        if new != text:
            with open(full, "w") as f:
                f.write(new)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
