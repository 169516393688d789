"""Rough edges a newcomer meets in the first hour, one test each."""

import json
import os
import subprocess
import sys

from kerasdist.run import _rank
from kerasdist.run import job
from tests.support.helpers import launcher_env


def _script(tmp_path, name="train.py", mode=0o644):
    path = tmp_path / name
    path.write_text("print('hi')\n")
    os.chmod(path, mode)
    return path


def test_script_without_python_is_named_with_the_fix(tmp_path, monkeypatch):
    _script(tmp_path)
    monkeypatch.chdir(tmp_path)
    problem = _rank.command_problem("train.py")
    assert "not a command on PATH" in problem
    assert "`python train.py`" in problem
    problem = _rank.command_problem(os.path.join(".", "train.py"))
    assert "is not executable" in problem and "python ./train.py" in problem


def test_executable_or_unknown_commands_are_left_alone(tmp_path):
    run = _script(tmp_path, "run.sh", 0o755)
    assert _rank.command_problem(str(run)) is None
    assert _rank.command_problem("python") is None
    assert _rank.command_problem(str(tmp_path / "missing.py")) is None


def test_launcher_refuses_a_script_without_python_in_one_line(tmp_path):
    _script(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "kerasdist.run", "-np", "2", "train.py"],
        cwd=tmp_path, env=launcher_env(), capture_output=True, text=True,
        timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        "kerasdist run: error: 'train.py' is a file here but not a command "
        "on PATH: to run a Python script write `python train.py`."]


def test_failure_seen_after_the_job_ended_says_so():
    findings = job.Findings()
    findings.add_failure(job.RankFailure("1", "node2", 3))
    lines = []

    class _Log:
        def line(self, text):
            lines.append(text)

    outcome = job._outcome(3, None, findings, None, None, _Log())
    assert outcome.exit_code == 3
    assert lines == ["rank 1 (host node2) exited with code 3; the job has "
                     "ended."]


def test_distributed_optimizer_takes_an_optimizer_name():
    code = (
        "import keras, kerasdist as kd\n"
        "kd.init()\n"
        "opt = kd.DistributedOptimizer('adam')\n"
        "assert isinstance(opt, keras.optimizers.Adam), type(opt)\n"
        "assert abs(float(opt.learning_rate) - 0.001) < 1e-9\n"
        "try:\n"
        "    kd.DistributedOptimizer('no-such-optimizer')\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n")
    p = subprocess.run([sys.executable, "-c", code], env=launcher_env(
        dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")), capture_output=True,
        text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ERR DistributedOptimizer: Could not interpret optimizer " \
           "identifier: no-such-optimizer" in p.stdout, p.stdout


def test_trainer_resume_line_after_the_last_epoch():
    from kerasdist.trainer import resume
    done = resume.Resumed(epoch=10, samples=0, world_size=2, rng=[])
    assert resume.describe(done, 10, 2, True) == (
        "after its last epoch (10 of 10 done): nothing is left to train; "
        "raise `epochs` to train more")
    middle = resume.Resumed(epoch=4, samples=0, world_size=2, rng=[])
    assert resume.describe(middle, 10, 2, True) == "at epoch 5 of 10"


def test_doctor_fails_when_jax_is_installed_without_its_op_library(
        tmp_path, monkeypatch):
    from kerasdist._core import capi
    from kerasdist.tools import doctor
    monkeypatch.setattr(capi, "NATIVE_DIR", str(tmp_path))
    status, message = doctor.jax_check("0.10.2", doctor._jax_library())
    assert status == doctor.FAIL
    assert "JAX op library was not built" in message
    assert "pip install --no-build-isolation -e ." in message
    assert doctor.jax_check(None, doctor._jax_library())[0] == doctor.INFO


def test_doctor_loads_the_built_jax_op_library():
    from kerasdist.tools import doctor
    path, problem = doctor._jax_library()
    if doctor._version("jax")[0] is None:
        assert doctor.jax_check(None, (path, problem))[0] == doctor.INFO
        return
    # The test requirements install jax before kerasdist is built.
    assert problem is None, (path, problem)
    assert doctor.jax_check("0.10.2", (path, problem))[0] == doctor.OK


def test_check_build_reads_versions_without_importing_frameworks():
    code = ("import sys\n"
            "from kerasdist.tools import doctor\n"
            "rows = dict(doctor.check_build_rows())\n"
            "assert rows['JAX op library'] in ('built', 'not built'), rows\n"
            "heavy = [m for m in ('tensorflow', 'jax', 'torch')\n"
            "         if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    p = subprocess.run([sys.executable, "-c", code], env=launcher_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]


def test_timeline_steps_are_counted_on_a_gradient_not_the_start_up(
        tmp_path):
    # A model.fit trace: the start-up broadcast is negotiated once, first;
    # then one gradient per step, three steps.
    from kerasdist.tools import timeline

    def neg(tid, ts):
        return {"ph": "X", "name": "NEGOTIATE", "pid": 0, "tid": tid,
                "ts": ts, "dur": 10, "args": {}}

    events = [neg(1, 0)] + [neg(2, 100 + 1000 * k) for k in range(3)]
    events.append({"ph": "X", "name": "ALLREDUCE", "pid": 0, "tid": 2,
                   "ts": 2150, "dur": 50, "args": {}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    trace = timeline.load(str(path))
    assert timeline._step_window(trace, 1, 0) == (100, 1100)
    assert timeline._step_window(trace, 1, 1) == (1100, 2100)
    assert timeline._step_window(trace, 2, 1) == (1100, 2200)


def test_a_job_of_one_outside_any_launcher_says_so_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import kerasdist as kd\n"
                      "kd.init(); kd.init()\n"
                      "print(kd.size())\n")
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                       env=launcher_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout == "1\n", p.stderr
    assert p.stderr.splitlines() == [
        "kerasdist: no launcher started this process, so it runs as a job "
        f"of one; to train on N processes run `kerasdist run -np N python "
        f"{script}`."], p.stderr
    # Under the launcher, a job of one is what was asked for: no hint.
    p = subprocess.run([sys.executable, "-m", "kerasdist.run", "-np", "1",
                        sys.executable, str(script)], cwd=tmp_path,
                       env=launcher_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no launcher" not in p.stdout + p.stderr, p.stdout + p.stderr


# setup.py's progress lines, without running setup(): its two helpers.
_PROGRESS_CODE = """
import ast, os, stat, sys
tree = ast.parse(open(sys.argv[1]).read())
keep = [n for n in tree.body if getattr(n, "name", "") in
        ("_pip_ancestor", "_share_fd", "_Progress")]
ns = {"os": os, "stat": stat, "sys": sys}
exec(compile(ast.Module(keep, []), "setup.py", "exec"), ns)
progress = ns["_Progress"]()
progress.say("kerasdist:   built libkerasdist_core.so (1 s)")
progress.close()
"""


def test_build_progress_reaches_pips_output_through_a_pipe(tmp_path):
    # A stand-in for pip: its argv names pip, it captures the build's
    # output (showing it only as CAPTURED), and its own stderr is a pipe.
    stub = tmp_path / "pip"
    stub.write_text(
        "import subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print('CAPTURED', repr(p.stdout + p.stderr))\n")
    setup_py = os.path.join(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), "setup.py")
    p = subprocess.run(
        [sys.executable, str(stub), sys.executable, "-c", _PROGRESS_CODE,
         setup_py], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "kerasdist:   built libkerasdist_core.so (1 s)\n", \
        (p.stdout, p.stderr)
    assert p.stdout == "CAPTURED ''\n", p.stdout
    # Without pip, the lines go to the build's own stderr.
    p = subprocess.run([sys.executable, "-c", _PROGRESS_CODE, setup_py],
                       capture_output=True, text=True, timeout=60)
    assert p.stderr == "kerasdist:   built libkerasdist_core.so (1 s)\n", \
        p.stderr


def test_build_progress_stays_in_a_log_that_pips_output_goes_to(tmp_path):
    # `pip install ... > log 2>&1`: pip's stderr is a file it writes at its
    # own place in; a line appended at the end would be overwritten by
    # pip's next line. The stand-in writes a line before and after the
    # build; all three must be in the log, in order.
    stub = tmp_path / "pip"
    stub.write_text(
        "import subprocess, sys\n"
        "sys.stderr.write('Building editable: started\\n')\n"
        "sys.stderr.flush()\n"
        "subprocess.run(sys.argv[1:], capture_output=True, check=True)\n"
        "sys.stderr.write('Building editable: finished with status done\\n')\n")
    setup_py = os.path.join(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), "setup.py")
    log = tmp_path / "log"
    with open(log, "w") as f:  # as the shell's `>`: truncated, no append
        subprocess.run([sys.executable, str(stub), sys.executable, "-c",
                        _PROGRESS_CODE, setup_py], stdout=f, stderr=f,
                       timeout=60, check=True)
    assert log.read_text() == (
        "Building editable: started\n"
        "kerasdist:   built libkerasdist_core.so (1 s)\n"
        "Building editable: finished with status done\n"), log.read_text()


def test_doctor_names_pytorch_and_the_active_keras_backend(tmp_path):
    from kerasdist.tools import doctor
    assert doctor.torch_check(None)[0] == doctor.INFO
    assert doctor.torch_check("2.13.0") == (
        doctor.OK, "PyTorch 2.13.0 (kerasdist.torch needs nothing built)")
    assert doctor.active_backend({"KERAS_BACKEND": "jax"}) == (
        "jax", "KERAS_BACKEND")
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    assert doctor.active_backend({"KERAS_HOME": str(tmp_path)}) == (
        "torch", str(tmp_path / "keras.json"))
    assert doctor.active_backend({"KERAS_HOME": str(tmp_path / "no")}) == (
        "tensorflow", "Keras' default")
    assert doctor.backend_check("torch", "KERAS_BACKEND", "2.13.0") == (
        doctor.OK, "Keras backend torch 2.13.0 (from KERAS_BACKEND)")
    status, message = doctor.backend_check("torch", "KERAS_BACKEND", None)
    assert status == doctor.FAIL and "torch is not installed" in message
    status, message = doctor.backend_check("numpy", "KERAS_BACKEND", None)
    assert status == doctor.FAIL and "tensorflow, jax and torch" in message
