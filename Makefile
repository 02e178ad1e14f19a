# Every target makes .venv first when it is missing, so a fresh clone needs
# nothing but Python 3.11+ and make.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint fmt bench chaos dashboards clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	scripts/debian-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/python -m examples.demo

lint: $(STAMP)
	$(BIN)/ruff check saga_otel sidecar tests bench examples dashboards
	$(BIN)/ruff format --check saga_otel sidecar tests bench examples dashboards
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format saga_otel sidecar tests bench examples dashboards
	$(BIN)/ruff check --fix saga_otel sidecar tests bench examples dashboards

bench: $(STAMP)
	$(BIN)/python -m bench

dashboards: $(STAMP)
	$(BIN)/python -m dashboards.generate

chaos: $(STAMP)
	$(BIN)/python -m pytest -m chaos $(PYTEST_ARGS)
	$(BIN)/python -m bench.reliability

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
