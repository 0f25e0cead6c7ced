# Two commands do all set-up: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Without a GPU we must never pull a multi-GB CUDA build of torch: pin the CPU build first, and the
# project's own `torch>=2.5` range is then already satisfied. Override TORCH_SPEC/TORCH_PIP_ARGS to
# point pip at another CPU wheel index on machines whose default index serves CUDA builds.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
# Axolotl's release pins an older transformers, peft and pydantic: the export round trip only
# needs its config schema, which imports with these (no dependencies pulled; the version is
# autotune/core/exports/axolotl.py's AXOLOTL_VERSION).
AXOLOTL_SPEC ?= axolotl==0.19.0 addict pillow posthog distro
# pip leaves bytecode to the first import (--no-compile): compiling every file of torch and
# transformers took 45 s of CPU out of 75 s of install, for modules the tests mostly never import.
# So Python must be allowed to cache what it compiles, whatever the caller's environment says.
PIP_INSTALL := $(PY) -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
# Parallel test processes (pytest-xdist); tests/conftest.py gives each one intra-op thread.
# Three on two cores: part of the suite's time is spent waiting on servers, workers and child
# processes, which a third process fills (4m02 against 4m10 with two, without the e2e tests;
# 5m23 against 5m52 when they were part of `make test`).
TEST_WORKERS ?= 3

# The browser tests drive Debian's Chromium (Playwright's own download cannot work offline);
# installed once, as root or through sudo.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: env run test e2e suite lint typecheck bench screenshots clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifneq ($(HAS_GPU),yes)
	$(PIP_INSTALL) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
endif
	DS_BUILD_OPS=0 $(PIP_INSTALL) -e '.[all,dev]'
	$(PIP_INSTALL) --no-deps $(AXOLOTL_SPEC)
	touch $@

env: $(VENV)/.installed

$(CHROMIUM):
	$(SUDO) apt-get install -y --no-install-recommends chromium \
		|| ($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium)

# `make run DEMO_STOP=1` stops the server after the result; DEMO_ARGS passes more flags
# (python -m autotune.cli.demo --help), e.g. DEMO_ARGS="--memory 2GiB --start-method forkserver".
run: env
	$(PY) -m autotune.cli.demo $(DEMO_ARGS)

lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: env
	$(PY) -m mypy

test: env lint
	$(MAKE) --no-print-directory -j2 typecheck suite

# The slow end-to-end tests (marked e2e: worker fleets, the demo, schema fuzzing of a live
# server, spawned trial children, whole tunes, any test of 9 s or more): longer than the 6
# minutes `make test` may take, so CI runs them after it (.ci/run).
e2e: env $(CHROMIUM)
	AUTOTUNE_TEST_CHROMIUM=$(CHROMIUM) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup \
		--durations=10 -m e2e

# The suite alone; `make test` runs mypy beside it (17 s of one core, cold, in a fresh clone).
# Not -q: the header shows pytest-randomly's seed (rerun an order with -p randomly
# --randomly-seed=N). Tests sharing a costly module fixture are one xdist_group (--dist loadgroup).
suite: env $(CHROMIUM)
	AUTOTUNE_TEST_CHROMIUM=$(CHROMIUM) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25 \
		-m "not e2e"

bench: env
	$(PY) bench/probe_trials.py
	$(PY) bench/tuner_regret.py
	$(PY) bench/api_load.py
	$(PY) bench/long_poll.py
	$(PY) bench/pages.py
	$(PY) bench/first_hour.py
	$(PY) bench/fidelity.py grid
	$(PY) bench/fidelity.py published
	$(PY) bench/finetune.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache

# The README's screenshots of the web pages (docs/images/), from a real server and worker.
screenshots: env $(CHROMIUM)
	AUTOTUNE_TEST_CHROMIUM=$(CHROMIUM) $(PY) -m tests.screenshots
