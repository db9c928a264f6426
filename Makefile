# Two entry points for a fresh machine: `make demo` and `make test`.
# Everything installs into .venv at the repository root; nothing else is touched.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hettp-installed

.PHONY: setup demo test lint compare corpus clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel first: a looser torch requirement would pull a multi-GB CUDA build (PyPI's
	# Linux torch). From the configured sources (a wheel folder), else PyTorch's CPU index.
	$(PY) -m pip install --quiet torch==2.13.0+cpu || \
		$(PY) -m pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install --quiet -e '.[cpu,test]' --config-settings editable_mode=compat
	touch $(STAMP)

demo: setup
	$(PY) scripts/demo.py

# Lint and format check first (ruff, configured in pyproject.toml): CI runs this target.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

compare: setup
	$(PY) scripts/compare.py

corpus: setup
	$(PY) scripts/preprocess_data.py --stdlib --output-prefix data/stdlib --max-bytes 8000000

clean:
	rm -rf $(VENV) logs data checkpoints .pytest_cache
