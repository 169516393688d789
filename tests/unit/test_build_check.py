"""At `import kerasdist`, a TensorFlow or JAX other than the one the op
libraries were built for gives one line on stderr saying which version they
were built for, which is installed, and the two ways out
(kerasdist/_core/build_check.py).

Each test imports, in a fresh interpreter, a copy of the package whose
_build_info.json (the record ops/Makefile writes) names the versions wanted.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _installed(*dists):
    """(distribution, version) of the first of `dists` installed."""
    for dist in dists:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


TF_DIST, TF = _installed("tensorflow-cpu", "tensorflow", "tensorflow-gpu",
                         "tf-nightly")
_, JAX = _installed("jax")


def _import_copy(tmp_path, info, code="import kerasdist"):
    """Runs `code` against a copy of the package (no native libraries)
    whose build record is `info` (None: no record)."""
    shutil.copytree(os.path.join(REPO_ROOT, "kerasdist"),
                    tmp_path / "kerasdist",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__",
                                                  ".kerasdist_*"))
    record = tmp_path / "kerasdist" / "_build_info.json"
    if record.exists():
        record.unlink()
    if info is not None:
        record.write_text(json.dumps(info))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path)
    return subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)


def _tf_line(built, ways_out):
    return (f"kerasdist: its TensorFlow op library was built for TensorFlow "
            f"{built} but TensorFlow {TF} is installed: pip install "
            f"{TF_DIST}=={built}, or build kerasdist from source for "
            f"TensorFlow {TF} (needs a C++17 compiler and make): {ways_out}")


WHEEL_WAY = "pip install --no-build-isolation . in a kerasdist source tree"


@pytest.mark.skipif(TF is None, reason="TensorFlow is not installed")
def test_another_tensorflow_gives_one_line(tmp_path):
    p = _import_copy(tmp_path, {"tensorflow": "2.0.0", "python": "3.11.7"})
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [_tf_line("2.0.0", WHEEL_WAY)]


@pytest.mark.skipif(TF is None or JAX is None,
                    reason="TensorFlow or jax is not installed")
def test_another_tensorflow_and_jax_give_a_line_each(tmp_path):
    p = _import_copy(tmp_path, {"tensorflow": "2.0.0", "jax": "0.1.0"})
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [
        _tf_line("2.0.0", WHEEL_WAY),
        f"kerasdist: its JAX op library was built for JAX 0.1.0 but JAX "
        f"{JAX} is installed: pip install \"jax[cpu]==0.1.0\", or build "
        f"kerasdist from source for JAX {JAX} (needs a C++17 compiler and "
        f"make): {WHEEL_WAY}"]


@pytest.mark.skipif(TF is None, reason="TensorFlow is not installed")
def test_in_a_source_tree_the_line_names_its_rebuild(tmp_path):
    (tmp_path / "setup.py").write_text("")  # a source tree's marker
    p = _import_copy(tmp_path, {"tensorflow": "2.0.0"})
    assert p.stderr.splitlines() == [_tf_line(
        "2.0.0", f"pip install --no-build-isolation -e {tmp_path}")]


def test_the_versions_built_for_say_nothing_and_import_nothing(tmp_path):
    info = {k: v for k, v in (("tensorflow", TF), ("jax", JAX)) if v}
    p = _import_copy(tmp_path, info, "import sys, kerasdist\n"
                     "print(sorted({'tensorflow', 'jax'} & set(sys.modules)))")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert p.stdout == "[]\n"  # the check imported neither framework


def test_no_build_record_says_nothing(tmp_path):
    p = _import_copy(tmp_path, None)
    assert p.returncode == 0 and p.stderr == "", p.stderr
