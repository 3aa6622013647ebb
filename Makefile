# Every install step lives here: `make test` and `make demo` work on a fresh clone, offline except for pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install browser test test-fast lint docs demo demo-vision bench clean

install: $(STAMP)

# torch first, alone and pinned: otherwise pip resolves a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $(STAMP)

# Debian's chromium, in which tests/cli/test_advise_page.py renders the advise page (skipped without it): installed
# only where it is missing and apt-get can install it (root on Debian, as CI runs); elsewhere a no-op.
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ echo "make browser: installing Debian's chromium with apt-get (as root) for tests/cli/test_advise_page.py"; \
		  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# Whole files to the 2 workers, the longest first (tests/durations.json, see docs/development.md); the 15 slowest
# tests printed at the end.
PYTEST := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q \
	--durations=15

test: install browser
	$(PYTEST)

# Everything but the tests that run a real trainer or compile (marked slow).
test-fast: install browser
	$(PYTEST) -m "not slow"

# Settings: pyproject.toml ([tool.ruff], [tool.mypy] strict on the planning core, [tool.importlinter] the layers of
# docs/architecture.md and no import cycle), mkdocs.yml (broken links fail).
lint: install
	$(VENV)/bin/ruff check shapeplan tests benchmarks scripts
	$(VENV)/bin/mypy shapeplan
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

# The docs site (mkdocs.yml; strict: a broken link or anchor fails), into site/.
docs: install
	$(VENV)/bin/mkdocs build --strict

demo: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/shapeplan analyze examples/capybara-sample.jsonl \
		--model examples/tiny-qwen3 --per_device_train_batch_size 4 --max_length 1024 --num_train_epochs 1 \
		--eval-dataset examples/capybara-sample.jsonl --eval_strategy steps --eval_steps 10
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/shapeplan advise examples/capybara-sample.jsonl \
		--model examples/tiny-qwen3 --per_device_train_batch_size 4 --max_length 1024 --num_train_epochs 1 \
		--eval-dataset examples/capybara-sample.jsonl --eval_strategy steps --eval_steps 10

# The vision demo: four small images (examples/vision-demo/) in 24 `messages` rows, with the bundled tiny Qwen2.5-VL.
demo-vision: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/shapeplan analyze examples/vision-sample.jsonl \
		--model examples/tiny-qwen2.5-vl --per_device_train_batch_size 2 --max_length 1024 --num_train_epochs 1
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/shapeplan advise examples/vision-sample.jsonl \
		--model examples/tiny-qwen2.5-vl --per_device_train_batch_size 2 --max_length 1024 --num_train_epochs 1

bench: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
