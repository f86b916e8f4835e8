# Two commands set up everything on a fresh machine:
#   make train   # creates .venv, installs llama-jax, trains the tiny preset on bundled Shakespeare
#   make test    # creates .venv, installs llama-jax[test], runs the test suite
# Pass overrides with ARGS, e.g.  make train ARGS="train.steps=100 run.dir=runs/short"

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pytest-xdist workers; each test process sees 8 simulated CPU devices (tests/conftest.py).
WORKERS ?= 2

.PHONY: train test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/llama-jax train $(ARGS)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n $(WORKERS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
