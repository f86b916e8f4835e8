# Two commands set up everything on a fresh machine:
#   make train   # creates .venv, installs llama-jax, trains the tiny preset on bundled Shakespeare
#   make test    # creates .venv, installs llama-jax[test], lints and checks formatting with ruff, runs the tests
# Pass overrides with ARGS, e.g.  make train ARGS="train.steps=100 run.dir=runs/short"
# `make test-newest` runs the suite again on Python 3.12 in .venv-newest (each slow test in one leg only), where a plain install
# takes the newest jax: CI runs both ends of the supported range (PYTHON_NEWEST=/path/to/python3.12 to choose it). It installs
# the gpu extra too (jax's CUDA plugin, ~4.4 GB; no GPU needed): the tests that compile for GPUs with XLA:GPU
# (tests/test_gpu_target.py, `plan --target`) run there and skip elsewhere.
# `make gpu-check` checks an NVIDIA GPU in one table (bench/gpu_check.py; ARGS passed on, e.g. ARGS="--json out.json").

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pytest-xdist workers; each test process sees 8 simulated CPU devices (tests/conftest.py). loadfile: a test file's
# tests share one worker, so its module fixtures (compiled steps, real multi-process runs) are built once. Not
# loadgroup: under pytest 9 its xdist_group marks are silently ignored (xdist 3.8 renames item._nodeid, which pytest
# 9 no longer reads), and every worker rebuilt the fixtures.
# --no-loadscope-reorder: the files start in tests/conftest.py's order, the longest multi-process runs first.
WORKERS ?= 2
PYTHON_NEWEST ?= $(shell pyenv prefix 3.12 2>/dev/null || echo /usr)/bin/python3.12
EXTRAS ?= test
MARKS ?= not newest_leg

.PHONY: train test test-newest gpu-check install clean

# The venv installs with uv (from the package registry, into the venv) where it can: the same packages as pip
# resolves, in a fifth of the time (14 s instead of 72 s for the newest leg's test,gpu extras on 2 cores, most of
# it jax's CUDA plugin). Where uv cannot be installed, pip does it all. --compile-bytecode: the .pyc files are
# written at install, as pip does; without them, where PYTHONDONTWRITEBYTECODE is set (the development machines
# set it, and CI's timings match a venv without .pyc), every process compiles jax, flax and orbax from source
# again, hundreds of times in the tests: the 3.11 leg's tests took 963 s in a fresh clone, 812 s with them.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv || $(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	if [ -x $(BIN)/uv ]; then $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[$(EXTRAS)]'; \
	else $(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'; fi
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/llama-jax train $(ARGS)

test: $(VENV)/.installed
	$(BIN)/ruff check llama_jax tests bench launch
	$(BIN)/ruff format --check llama_jax tests bench launch
	$(BIN)/python -c 'import sys, jax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(BIN)/python -m compileall -q llama_jax  # our own .pyc, as --compile-bytecode writes the packages' (above)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m '$(MARKS)' $(PYTEST_ARGS)

# Under launch/gpu_env.sh's settings (a bash script), so the check measures what the launch scripts run.
# Where nvidia-smi finds a GPU, the venv gets the CUDA build of jax first (the gpu extra: Python >= 3.12,
# e.g. make gpu-check PYTHON=python3.12 VENV=.venv-gpu); elsewhere the check says there is no GPU, in one line.
gpu-check: $(VENV)/.installed
	if nvidia-smi -L >/dev/null 2>&1; then $(BIN)/python -m pip install --quiet -e '.[gpu]'; fi
	bash -c 'source launch/gpu_env.sh && exec $(BIN)/python bench/gpu_check.py $(ARGS)'

# Each run of real processes (the tests marked slow, pyproject.toml) runs in one leg only, so that both legs stay
# inside CI's time: the newest leg runs those marked newest_leg (the Slurm launcher's; GPU clusters run Python >= 3.12
# and the newest jax), `make test` all the others. MARKS= (empty) runs every test.
test-newest:
	$(MAKE) test PYTHON=$(PYTHON_NEWEST) VENV=.venv-newest EXTRAS=test,gpu MARKS='not slow or newest_leg'

clean:
	rm -rf $(VENV) .venv-newest runs
