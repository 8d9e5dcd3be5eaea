VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench

# One venv from the repo's own files; torch is the CPU build (2.13.0) that this machine kind has on disk.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[all,dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/acelora demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	$(PY) benchmarks/route_overhead.py
