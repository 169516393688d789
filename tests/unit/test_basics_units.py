"""kerasdist's build queries in one process, without init."""

import kerasdist as kd


def test_mpi_built_is_always_true_and_nccl_built_is_a_bool():
    # The MPI backend is always compiled in; NCCL only where a build found
    # it. Both answer from the loaded library, before init().
    assert kd.mpi_built() is True
    assert isinstance(kd.nccl_built(), bool)
    assert not kd.is_initialized()
