# Two commands do everything on a fresh machine (README): `make demo` and `make test`.
# Each creates .venv, installs the package with its pinned dependencies, then runs.
PY     ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-gpu compile-report bench bench-smoke notebooks clean

$(STAMP): pyproject.toml
	@echo "== creating $(VENV) and installing engram-numba with its pinned dependencies (numba, numba-cuda, numpy,"
	@echo "== matplotlib, ...): about 3 minutes on a fresh machine, once; pip shows each package below"
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install --progress-bar on -e '.[test]'
	touch $(STAMP)
	@echo "== installed into $(VENV)"

# The main job: the demo on the tiny model shipped in data/ (the CUDA stages run in numba's
# simulator when there is no GPU).
demo: $(STAMP)
	$(BIN)/engram-numba demo

# Every tier that runs without a GPU: exact CPU tests, kernels under the simulator,
# compile-only for sm_90, notebooks. The gpu tier is skipped here (see test-gpu).
# The tests run on every core (pytest-xdist, -n auto), each test module on one worker so that its
# module-scoped fixtures (models, engines, a Dask cluster) are built once; the progress shows as a
# count of tests (-o console_output_style=count) and the 20 slowest tests are listed at the end.
# PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= auto
test: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(BIN)/python -m pytest -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadscope \
		-o console_output_style=count --durations=20 tests engram_numba notebooks --nbmake

# The loop while working: exact CPU tests and the kernels in the simulator with the tests marked
# `slow` deselected; no compile-only tier, no notebooks; on every core like `make test`.
# `make test` above still runs everything.
test-fast: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadscope \
		-m "not slow and not gpu" --ignore=tests/test_compile_tier.py tests engram_numba

# The gpu tier alone, on a machine with a CUDA GPU (docs/gpu.md; tests/gpu_run.sh does it with
# carried wheels on a machine without network).
test-gpu: $(STAMP)
	NUMBA_ENABLE_CUDASIM=0 $(BIN)/python -m pytest -q -p no:cacheprovider -m gpu tests engram_numba

compile-report: $(STAMP)
	NUMBA_ENABLE_CUDASIM=0 $(BIN)/python -m engram_numba.stages.compile_check

# The benchmark suite (needs a GPU); bench-smoke checks the suite itself in the simulator.
bench: $(STAMP)
	$(BIN)/engram-numba bench

bench-smoke: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(BIN)/engram-numba bench --smoke --out /tmp/engram_bench_smoke.json

# JupyterLab on the notebooks (installs the notebooks extra)
# (as root, the usual user in containers, JupyterLab needs --allow-root)
notebooks: $(STAMP)
	$(BIN)/python -m pip install -e '.[test,notebooks]'
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root,) notebooks/

clean:
	rm -rf $(VENV) .pytest_cache
