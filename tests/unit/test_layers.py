"""The native code's layers point one way, and its functions stay short.

- ops/core/backends/, ops/core/transport/ and ops/core/control/ (the
  backends, their transports and the control plane) include no runtime
  header: a backend sees only its own batch type and the settings (Config,
  config.h) its factory reads.
- The backends (ops/core/backends/) see their ranks only through the
  Communicator interface: no MPI header, so the core's C++ tests run them
  with ranks as threads (ops/tests/node_backends_test.cc).
- The TF op library reaches the core through its C API (ops/core/c_api.h,
  the seam every front end uses) and the few headers beside it (the enums,
  the CUDA hooks, the huge-page advice), none of which pulls in MPI or a
  runtime header; the built op library does not link MPI.
- No function in ops/ is longer than about a screen (60 lines of code, as
  lizard counts them).
"""

import os
import re
import subprocess

import pytest

from tests.support.helpers import REPO_ROOT

OPS = os.path.join(REPO_ROOT, "ops")
CORE = os.path.join(OPS, "core")
# The layers below the runtime (subfolders included).
LOWER = [os.path.join(CORE, d) for d in ("backends", "transport", "control")]
_INCLUDE = re.compile(r'^\s*#\s*include\s+([<"])([^>"]+)[>"]', re.M)

# The core's own headers that only the runtime may see.
RUNTIME_HEADERS = {"runtime.h", "process_sets.h", "controller.h",
                   "message.h", "layout.h", "timeline.h", "fusion.h",
                   "entry.h", "validate.h"}
# The core's headers a TF kernel may include: the C API, the enums its
# requests speak in, the CUDA hooks beside it (the GPU kernels' ready
# events) and the huge-page advice for the outputs the kernels reuse.
TF_SEAM = {"c_api.h", "types.h", "device_hooks.h", "host_buffer.h"}


def _includes(path):
    with open(path) as f:
        return [(kind, name) for kind, name in _INCLUDE.findall(f.read())]


def _sources(directory):
    return sorted(n for n in os.listdir(directory)
                  if n.endswith((".h", ".cc")))


def _lower_sources():
    for top in LOWER:
        for root, _, _ in os.walk(top):
            for name in _sources(root):
                yield os.path.join(root, name)


def test_lower_layers_include_no_runtime_header():
    paths = list(_lower_sources())
    assert paths, LOWER
    for path in paths:
        for kind, inc in _includes(path):
            target = os.path.normpath(os.path.join(os.path.dirname(path), inc))
            assert not (kind == '"' and os.path.dirname(target) == CORE
                        and os.path.basename(target) in RUNTIME_HEADERS), (
                f"{os.path.relpath(path, REPO_ROOT)} includes {inc}: "
                "backends must not see the runtime's types")


def _closure(start):
    """Every project header reachable from `start` (quoted includes)."""
    seen, todo = set(), [os.path.normpath(start)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for kind, inc in _includes(path):
            if kind == '"':
                nxt = os.path.normpath(os.path.join(os.path.dirname(path), inc))
                if os.path.exists(nxt):
                    todo.append(nxt)
    return seen


def _core_includes(path):
    """The core headers `path` includes (as "../core/x.h" or "core/x.h")."""
    return {inc.split("core/", 1)[1] for kind, inc in _includes(path)
            if kind == '"' and inc.startswith(("../core/", "core/"))}


def test_tf_ops_reach_the_core_through_its_c_api():
    for name in _sources(os.path.join(OPS, "tf")):
        core = _core_includes(os.path.join(OPS, "tf", name))
        assert core <= TF_SEAM, (name, sorted(core - TF_SEAM))
    for header in TF_SEAM:
        reach = _closure(os.path.join(CORE, header))
        for path in reach:
            for kind, inc in _includes(path):
                assert inc != "mpi.h", \
                    f"{path} (reached from {header}) includes mpi.h"
        names = {os.path.basename(p) for p in reach}
        assert not names & RUNTIME_HEADERS, (header, names & RUNTIME_HEADERS)


def test_op_library_does_not_link_mpi():
    import kerasdist
    lib = os.path.join(os.path.dirname(kerasdist.__file__), "_kerasdist_ops.so")
    if not os.path.exists(lib):
        pytest.skip("the TF op library is not built here")
    out = subprocess.run(["readelf", "-d", lib], capture_output=True,
                         text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", out)
    assert "libkerasdist_core.so" in needed, needed
    assert not [n for n in needed if "mpi" in n.lower()], needed


def test_backends_include_no_mpi():
    top = os.path.join(CORE, "backends")
    for root, _, _ in os.walk(top):
        for name in _sources(root):
            path = os.path.join(root, name)
            for _, inc in _includes(path):
                mpi = os.path.basename(inc) in ("mpi.h", "mpi_context.h")
                assert not mpi, (
                    f"{os.path.relpath(path, REPO_ROOT)} includes {inc}: a "
                    "backend reaches its ranks through Communicator "
                    "(transport/communicator.h)")


def test_no_function_in_ops_is_longer_than_a_screen():
    import lizard  # requirements-test.txt
    too_long = []
    for root, _, files in os.walk(OPS):
        for name in files:
            if not name.endswith((".cc", ".h", ".cu")):
                continue
            info = lizard.analyze_file(os.path.join(root, name))
            for fn in info.function_list:
                if fn.nloc > 60:
                    rel = os.path.relpath(os.path.join(root, name), REPO_ROOT)
                    too_long.append(f"{rel}:{fn.start_line} {fn.name} "
                                    f"({fn.nloc} lines)")
    assert not too_long, "split these functions:\n" + "\n".join(too_long)
