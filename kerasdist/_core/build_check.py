"""Are the TensorFlow and JAX installed the ones kerasdist's op libraries
were built for? ops/Makefile records those in _build_info.json.

At `import kerasdist` (see `warn()`), a mismatch prints one line on stderr:
which version the library was built for, which is installed, and the two
ways out. Loading the TensorFlow op library with a mismatch raises
ImportError with the same line (kerasdist/tensorflow/_native.py), and
`kerasdist doctor` says it too. Versions come from the packages' metadata:
nothing is imported.
"""

import importlib.metadata
import json
import os
import sys

# kerasdist/, where the native libraries and their record are.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_INFO = os.path.join(PACKAGE_DIR, "_build_info.json")

# framework -> (its name in messages, the distributions that install it)
_FRAMEWORKS = {
    "tensorflow": ("TensorFlow", ("tensorflow-cpu", "tensorflow",
                                  "tensorflow-gpu", "tf-nightly")),
    "jax": ("JAX", ("jax",)),
}


def build_info(path=BUILD_INFO):
    """What the native libraries were built for ({} when unknown)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def installed(framework):
    """(distribution, version) that installs `framework`, or (None, None)."""
    for dist in _FRAMEWORKS[framework][1]:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def source_build_command():
    """How to build kerasdist from source for the frameworks installed."""
    tree = os.path.dirname(PACKAGE_DIR)
    if os.path.exists(os.path.join(tree, "setup.py")):  # an editable install
        return f"pip install --no-build-isolation -e {tree}"
    return "pip install --no-build-isolation . in a kerasdist source tree"


def mismatch(framework, built, running, dist=None):
    """The line for `framework` (a key of _FRAMEWORKS) when its op library
    was built for version `built` and `running` is installed (from the
    distribution `dist`), or None when they agree or either is unknown."""
    if not built or not running or built == running:
        return None
    name = _FRAMEWORKS[framework][0]
    if framework == "jax":
        spec = f'"jax[cpu]=={built}"'
    else:
        spec = f"{dist or _FRAMEWORKS[framework][1][0]}=={built}"
    return (f"kerasdist: its {name} op library was built for {name} {built} "
            f"but {name} {running} is installed: pip install {spec}, or "
            f"build kerasdist from source for {name} {running} (needs a "
            f"C++17 compiler and make): {source_build_command()}")


def mismatches(info=None):
    """The mismatch lines for every framework the libraries were built
    for, as `info` (default: _build_info.json) records them."""
    info = build_info() if info is None else info
    lines = []
    for framework in _FRAMEWORKS:
        if info.get(framework):
            dist, version = installed(framework)
            line = mismatch(framework, info[framework], version, dist)
            if line:
                lines.append(line)
    return lines


_warned = False


def warn():
    """Prints each mismatch line on stderr, once per process."""
    global _warned
    if _warned:
        return
    _warned = True
    for line in mismatches():
        print(line, file=sys.stderr, flush=True)
