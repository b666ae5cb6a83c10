# `make demo` and `make test` are the README's two first commands; .ci/run runs `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-slow lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[worker,dev]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/qos up --engine sim --workers 2 --demo-load

lint: install
	$(BIN)/ruff check .

# Two test processes (pytest-xdist): most tests wait on processes they started (stacks,
# drains, back-offs), so two halve the wall time on the 2-core CI box (947 s -> 504 s measured).
test: install lint
	$(BIN)/pytest -q -n 2

test-slow: install
	$(BIN)/pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
