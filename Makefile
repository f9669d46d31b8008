# Two commands do everything on a fresh machine (README): `make demo` and `make test`.
# Each creates .venv, installs the package with its pinned dependencies, then runs.
PY     ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-gpu compile-report bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# The main job: the demo on the tiny model shipped in data/ (the CUDA stages run in numba's
# simulator when there is no GPU).
demo: $(STAMP)
	$(BIN)/engram-numba demo

# Every tier that runs without a GPU: exact CPU tests, kernels under the simulator,
# compile-only for sm_90, notebooks. The gpu tier is skipped here (see tests/gpu_run.sh).
test: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests notebooks --nbmake

compile-report: $(STAMP)
	NUMBA_ENABLE_CUDASIM=0 $(BIN)/python -m engram_numba.kernels.compile_check

clean:
	rm -rf $(VENV) .pytest_cache
