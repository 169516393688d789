# Developer shortcuts. The native build itself is ops/Makefile, run by
# setup.py (`pip install --no-build-isolation -e .`).
#
#   make test        lint, then the unit tests, then every other test tier
#   make lint        ruff and clang-format, checking only (seconds)
#   make fmt         apply ruff's fixes and clang-format to the tree
#   make test-unit   one process, no MPI (a few minutes)

PYTHON ?= python
CXX_SOURCES = $(shell find ops -name '*.cc' -o -name '*.h')

.PHONY: test lint fmt test-unit test-rest

test: lint test-unit test-rest

lint:
	ruff check .
	@clang-format --dry-run -Werror $(CXX_SOURCES) && \
	    echo "clang-format: $(words $(CXX_SOURCES)) C++ files formatted"

fmt:
	ruff check --fix .
	clang-format -i $(CXX_SOURCES)

test-unit:
	$(PYTHON) -m pytest tests/unit

# Everything but tests/unit: parallel, integration, cluster (gpu tests skip
# without a GPU).
test-rest:
	$(PYTHON) -m pytest tests --ignore=tests/unit
