# Every target makes .venv first when it is missing, so a fresh clone needs
# nothing but Python 3.11+ and make. Each installs what it needs: the demo the
# library and the sidecar (`.[sidecar]`), the rest everything (`.[dev]`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SIDECAR_STAMP := $(VENV)/.installed-sidecar
# The demo runs on a dev install too; it installs `.[sidecar]` only when there is none.
DEMO_STAMP := $(if $(wildcard $(STAMP)),$(STAMP),$(SIDECAR_STAMP))
LINTED := saga_otel sidecar tests bench examples dashboards

.PHONY: test demo lint fmt bench chaos dashboards clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(SIDECAR_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[sidecar]'
	touch $(SIDECAR_STAMP)

test: $(STAMP)
	scripts/debian-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(DEMO_STAMP)
	$(BIN)/python -m examples.demo

# ruff (rules and format), mypy strict on both packages, vulture for dead code
# (framework callbacks it cannot see being called: [tool.vulture] in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy
	$(BIN)/vulture

fmt: $(STAMP)
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

bench: $(STAMP)
	$(BIN)/python -m bench

dashboards: $(STAMP)
	$(BIN)/python -m dashboards.generate

chaos: $(STAMP)
	$(BIN)/python -m pytest -m chaos $(PYTEST_ARGS)
	$(BIN)/python -m bench.reliability

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache examples/node_agent/node_modules
