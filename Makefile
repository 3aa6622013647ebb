# Every install step lives here: `make test` and `make demo` work on a fresh clone, offline except for pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint demo bench clean

install: $(STAMP)

# torch first, alone and pinned: otherwise pip resolves a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadfile -q

# Everything but the tests that run a real trainer or compile (marked slow).
test-fast: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadfile -q -m "not slow"

# Settings in pyproject.toml: [tool.ruff], [tool.mypy] (strict on the planning core).
lint: install
	$(VENV)/bin/ruff check shapeplan tests benchmarks scripts
	$(VENV)/bin/mypy shapeplan

demo: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/shapeplan analyze examples/capybara-sample.jsonl \
		--model examples/tiny-qwen3 --per_device_train_batch_size 4 --max_length 1024 --num_train_epochs 1 \
		--eval-dataset examples/capybara-sample.jsonl --eval_strategy steps --eval_steps 10
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/shapeplan advise examples/capybara-sample.jsonl \
		--model examples/tiny-qwen3 --per_device_train_batch_size 4 --max_length 1024 --num_train_epochs 1 \
		--eval-dataset examples/capybara-sample.jsonl --eval_strategy steps --eval_steps 10

bench: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
