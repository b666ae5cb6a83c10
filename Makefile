# `make demo` and `make test` are the README's two first commands; .ci/run runs `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-slow lint bench-hot-path clean

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

# Issue 17's figures in one go (~6 min), to run when the machine is quiet: Redis' one-command
# floor (the "floor" row; a quiet hour's is 1.1-1.4 us) is printed before and after, so a
# run whose floor moved can be told and set aside. Figures as JSON under $(OUT).
OUT ?= /tmp/qos-hot-path
bench-hot-path: install
	mkdir -p $(OUT)
	$(BIN)/qos bench redis-budget --rounds 1 --requests 256 | grep "floor"
	for i in 1 2 3; do $(BIN)/qos bench overhead --seconds 8 --rate 200 --json $(OUT)/sim-$$i.json || exit 1; done
	for i in 1 2; do $(BIN)/qos bench overhead --seconds 8 --rate 200 --engine openai \
		--json $(OUT)/openai-$$i.json || exit 1; done
	$(BIN)/qos bench overhead --seconds 8 --rate 30 --engine openai --chunk-tokens 1 --step-ms 20 \
		--json $(OUT)/openai-stepped.json
	for b in 8 64; do $(BIN)/qos bench redis-budget --rounds 3 --push-batch $$b \
		--json $(OUT)/budget-$$b.json || exit 1; done
	$(BIN)/qos bench redis-budget --rounds 1 --requests 256 | grep "floor"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
