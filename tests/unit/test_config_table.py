"""The core's settings table and names reach Python, the docs, the launcher
and doctor unchanged: one source, no copies."""

import os
import re
import subprocess
import sys

import pytest

from kerasdist._core import capi as _capi
from kerasdist.run import launch_config
from kerasdist.run import settings as launcher_settings
from kerasdist.tools import doctor
from kerasdist.tools import settings_doc as _settings_doc
from tests.support.helpers import REPO_ROOT


@pytest.fixture
def clean_env(monkeypatch):
    """No KERASDIST_* variable from the caller's environment."""
    for name in list(os.environ):
        if name.startswith("KERASDIST_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_doc_table_is_the_generated_one():
    with open(os.path.join(REPO_ROOT, "docs", "env_vars.md")) as f:
        doc = f.read()
    begin = doc.index(_settings_doc.BEGIN)
    end = doc.index(_settings_doc.END) + len(_settings_doc.END) + 1
    assert doc[begin:end] == _settings_doc.markdown_table(), (
        "docs/env_vars.md's table differs from the core's; regenerate it "
        "with `python -m kerasdist.tools.settings_doc`.")


def test_table_lists_every_setting_once_with_a_doc_line():
    table = _capi.settings_table()
    names = [s.name for s in table]
    assert len(set(names)) == len(names)
    assert names == _capi.text("config_variables").split()
    assert len({s.key for s in table}) == len(table)
    for s in table:
        assert re.fullmatch(r"KERASDIST_[A-Z_]+", s.name), s
        assert s.doc.strip(), s


def test_resolved_defaults_are_the_table_defaults(clean_env):
    table = _capi.settings_table()
    resolved = _capi.resolve_settings()
    assert list(resolved) == [s.name for s in table]
    assert resolved == {s.name: s.default for s in table}
    # A few defaults stated independently (docs and Horovod-era choices).
    assert resolved["KERASDIST_FUSION_THRESHOLD"] == str(64 * 1024 * 1024)
    assert resolved["KERASDIST_SHM_ALLREDUCE"] == "1"
    assert resolved["KERASDIST_RESTART_ATTEMPT"] == "0"
    assert resolved["KERASDIST_GPU_OPERATIONS"] == "NCCL"


def test_environment_then_overrides(clean_env):
    clean_env.setenv("KERASDIST_CYCLE_TIME", "0.5")
    clean_env.setenv("KERASDIST_SHM_ALLREDUCE", "no")
    got = _capi.resolve_settings("KERASDIST_CYCLE_TIME=0.2\n"
                                 "KERASDIST_AUTOTUNE=True")
    assert got["KERASDIST_CYCLE_TIME"] == "0.2"  # the override wins
    assert got["KERASDIST_SHM_ALLREDUCE"] == "0"
    assert got["KERASDIST_AUTOTUNE"] == "1"
    # A choice (no Config member) reads back as the text given.
    clean_env.setenv("KERASDIST_GPU_OPERATIONS", "MPI")
    assert _capi.resolve_settings()["KERASDIST_GPU_OPERATIONS"] == "MPI"


@pytest.mark.parametrize("text,value", [
    ("1", "1"), ("true", "1"), ("True", "1"), ("yes", "1"),
    ("0", "0"), ("false", "0"), ("False", "0"), ("no", "0"), ("", "0")])
def test_booleans_parse_as_the_core_documents(text, value):
    assert _capi.parse_setting("KERASDIST_SHM_ALLREDUCE", text) == value


@pytest.mark.parametrize("name,text,message", [
    ("KERASDIST_SHM_ALLREDUCE", "on",
     'KERASDIST_SHM_ALLREDUCE="on": expected 0 or 1.'),
    ("KERASDIST_FUSION_THRESHOLD", "64MB",
     'KERASDIST_FUSION_THRESHOLD="64MB": expected an integer >= 0.'),
    ("KERASDIST_CYCLE_TIME", "-1",
     'KERASDIST_CYCLE_TIME="-1": expected a number >= 0.'),
    ("KERASDIST_GPU_OPERATIONS", "nccl",
     'KERASDIST_GPU_OPERATIONS="nccl": expected NCCL or MPI.'),
    ("KERASDIST_NOPE", "1", "unknown setting KERASDIST_NOPE."),
])
def test_malformed_values_name_the_variable(name, text, message):
    with pytest.raises(ValueError) as e:
        _capi.parse_setting(name, text)
    assert str(e.value) == message


def test_init_keywords_are_the_table_keys():
    import kerasdist as kd

    with pytest.raises(ValueError) as e:
        kd.init(no_such_setting=1)
    listed = set(re.findall(r"'([a-z_]+)'", str(e.value).split("expected")[1]))
    assert listed == {s.key for s in _capi.settings_table() if s.in_init}
    # Unchanged public API: these two are not init() keywords.
    assert not listed & {"gpu_operations", "restart_attempt"}
    assert {"fusion_threshold", "cycle_time_ms", "shm_allreduce"} <= listed


def test_enum_values_are_the_c_api_abi():
    import numpy as np

    import kerasdist as kd

    # Horovod's reduce-op numbering (scripts passing ints move over).
    assert (kd.Average, kd.Sum, kd.Min, kd.Max, kd.Product) == (0, 1, 3, 4, 5)
    codes = _capi.dtype_codes()
    assert _capi.DTYPES[np.dtype(np.float32)] == codes["float32"]
    assert _capi.BFLOAT16 == codes["bfloat16"]
    assert np.dtype(np.float16) in _capi.DTYPES
    for name, code in _capi.op_types().items():
        assert getattr(_capi, "OP_" + name.upper()) == code
    # The codes drive the library: float16 <-> float32 through its converter.
    x = np.array([1.5, -2.0, 65504.0], np.float32)
    half = np.empty(3, np.uint16)
    assert _capi.lib().kerasdist_convert16(
        codes["float16"], 0, 0, x.ctypes.data, half.ctypes.data, 3) == 0
    np.testing.assert_array_equal(half.view(np.float16), x.astype(np.float16))


def test_timeline_names_come_from_the_core():
    from kerasdist.tools import timeline as timeline_tools

    phases = _capi.timeline_phases()
    assert timeline_tools.phase_names()[0] == "NEGOTIATE"
    assert timeline_tools.phase_names()[-1] == "MEMCPY_OUT_FUSION_BUFFER"
    # Every collective's phase, and a hierarchical allreduce's cross-host one.
    assert set(timeline_tools.collective_names()) == {
        n.upper() for n in _capi.op_types()} | {"CROSS_ALLREDUCE"}
    assert [n for n, r in phases.items() if r in ("host_in", "host_out")] == [
        "NODE_ALLREDUCE", "NODE_BROADCAST"]
    assert [n for n, r in phases.items() if r == "marker"] == ["CYCLE"]


def test_launcher_names_come_from_the_core_without_tensorflow():
    code = ("import sys; from kerasdist.run import settings; "
            "env = settings.build_env(1, fusion_threshold_mb=1, "
            "cycle_time_ms=2, timeline_filename='/t.json', autotune=True); "
            "print(sorted(env)); "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'numpy', 'keras')]; assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    keys = ("fusion_threshold", "cycle_time_ms", "timeline", "autotune",
            "restart_attempt")
    assert out.stdout.strip() == str(sorted(_capi.setting_name(k)
                                            for k in keys))


def test_every_launcher_flag_exists():
    for key, flag in launcher_settings.LAUNCHER_FLAGS.items():
        _capi.setting_name(key)  # a KeyError names a setting the core lacks
        argv = [flag] if flag == "--autotune" else [flag, "1"]
        launch_config.parse_args(["-np", "1"] + argv + ["true"])


def test_doctor_reads_booleans_through_the_core():
    # Words the core reads as off, and one it does not read at all.
    assert doctor.shm_check(None, 2, "no")[0] == doctor.INFO
    assert doctor.shm_check(None, 2, "")[0] == doctor.INFO
    assert doctor.shm_check(None, 2, "yes")[0] == doctor.WARN
    with pytest.raises(ValueError, match="expected 0 or 1"):
        doctor.shm_check(None, 2, "on")


def test_doctor_reports_a_malformed_setting(clean_env):
    clean_env.setenv("KERASDIST_CACHE_CAPACITY", "lots")
    lines = [m for s, m in doctor.install_checks(2) if s == doctor.FAIL]
    assert any('KERASDIST_CACHE_CAPACITY="lots"' in m for m in lines), lines
