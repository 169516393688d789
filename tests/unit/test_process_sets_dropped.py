"""A process set lives as long as the runtime it was added to
(kerasdist/process_sets.py): after `shutdown()` and `init()`, the path a
recovery in place takes (tests/cluster/test_recovery.py covers that one on
3 ranks), the old ProcessSet fails with one error saying why; given to
`init(process_sets=...)` again it is added again. A job of one, where the
only set is the whole job's ranks ([0], id 0)."""

import subprocess
import sys

from tests.support.helpers import launcher_env

_SCRIPT = """
import kerasdist as kd
ps = kd.ProcessSet([0])
kd.init(process_sets=[ps])
print("before", ps.process_set_id, kd.allgather_object(1, process_set=ps))
kd.shutdown()
kd.init()
try:
    kd.allgather_object(1, process_set=ps)
except ValueError as e:
    print("error", e)
try:
    ps.included()
except ValueError as e:
    print("included", "dropped" in str(e))
kd.shutdown()
kd.init(process_sets=[ps])
print("again", ps.process_set_id, kd.allgather_object(2, process_set=ps))
"""


def test_process_sets_dropped_at_shutdown_and_init_added_again(tmp_path):
    script = tmp_path / "sets.py"
    script.write_text(_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                       env=launcher_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "before 0 [1]", lines
    assert lines[1] == (
        "error ProcessSet(process_set_id=None, ranks=[0], mpi_comm=None): "
        "this process set was dropped when kerasdist shut down "
        "(kerasdist.shutdown()) and started again; its ranks are the old "
        "job's. Add the set again with the new ranks "
        "(kerasdist.add_process_set([...]) on every rank, e.g. in a reset "
        "callback: state.register_reset_callbacks) and use the ProcessSet "
        "it returns."), lines
    assert lines[2:] == ["included True", "again 0 [2]"], lines
