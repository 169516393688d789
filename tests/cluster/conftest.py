"""Fixtures the cluster tests share: kerasdist built against Open MPI
(tests/support/site_mpi.py), once per session."""

import pytest

from tests.support import site_mpi


@pytest.fixture(scope="session")
def openmpi_root(tmp_path_factory):
    """A directory whose kerasdist package is built against Open MPI (the
    `root` of tests.support.helpers.launch / cluster.run_on)."""
    home = site_mpi.openmpi_home()
    if home is None:
        pytest.skip(f"no Open MPI for the tests: {site_mpi.OPENMPI_INSTALL}")
    return site_mpi.build(str(tmp_path_factory.mktemp("openmpi-build")),
                          KERASDIST_MPI_HOME=home)


@pytest.fixture(scope="session")
def openmpi_tf_root(tmp_path_factory):
    """As `openmpi_root`, with TensorFlow's op library too (TF=1): its
    objects include no mpi.h, so they are the editable build's; the build
    only links and imports TensorFlow for its flags (13 s here)."""
    home = site_mpi.openmpi_home()
    if home is None:
        pytest.skip(f"no Open MPI for the tests: {site_mpi.OPENMPI_INSTALL}")
    return site_mpi.build(str(tmp_path_factory.mktemp("openmpi-tf-build")),
                          KERASDIST_MPI_HOME=home, TF=1)
