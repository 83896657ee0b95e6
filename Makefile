# Two commands on a fresh machine:
#   make quickstart   set up .venv, prepare Shakespeare, train (CPU config, or the baby GPT on a GPU), sample
#   make test         set up .venv with the test dependencies and run the suite
#   make test-fast    the tests that start no process of their own, in under 2 minutes
#   make lint         ruff check and ruff format --check, as CI runs them before make test
# Both keep a GPU build of torch (>= scripts/system_torch.py's floor) that python3 already has.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SHAKESPEARE_TXT ?= $(wildcard ../shared/data/tinyshakespeare/input.txt)

.PHONY: quickstart test test-fast lint venv clean

venv: $(VENV)/.installed

# re-install only when the requirement files change. A GPU build of torch at or above the supported
# floor that $(PYTHON) already imports is the machine's own, matched to its driver: the venv sees it
# (--system-site-packages), pip installs the rest without torch and may not replace it (a constraint).
# Elsewhere, or with SYSTEM_TORCH=no, the venv gets the torch pinned in requirements.txt.
SYSTEM_TORCH ?= auto
$(VENV)/.installed: requirements.txt requirements-dev.txt scripts/system_torch.py
	@if [ "$(SYSTEM_TORCH)" != no ] && version=$$($(PYTHON) scripts/system_torch.py); then \
		set -ex; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
		grep -v '^torch[=<>~ ]' requirements.txt > $(VENV)/requirements-without-torch.txt; \
		echo "torch==$$version" > $(VENV)/keep-torch.txt; \
		$(PY) -m pip install --quiet --upgrade pip; \
		$(PY) -m pip install --quiet -c $(VENV)/keep-torch.txt -r $(VENV)/requirements-without-torch.txt -r requirements-dev.txt; \
	else \
		set -ex; \
		$(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install --quiet --upgrade pip; \
		$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt; \
	fi
	touch $@

# --overwrite=True: a second make quickstart trains afresh over the first run's out_dir
quickstart: venv
	$(PY) data/shakespeare_char/prepare.py $(if $(SHAKESPEARE_TXT),--input $(SHAKESPEARE_TXT))
	@if $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) train.py config/train_shakespeare_char_fast.py --overwrite=True && \
		$(PY) sample.py --out_dir=out-shakespeare-char-fast --num_samples=1 --max_new_tokens=500; \
	else \
		$(PY) train.py config/train_shakespeare_char_cpu.py --overwrite=True && \
		$(PY) sample.py --out_dir=out-shakespeare-char-cpu --num_samples=1 --max_new_tokens=500; \
	fi

# one pytest-xdist worker per core, one thread each: the tests' models are tiny, and OpenMP threads
# spinning beside another worker's cost more than they give; inductor compiles in the test's own
# process, not in a pool of fresh interpreters. A file's tests stay on one worker (--dist loadfile),
# so a module's shared run is built once. A test still running at --timeout fails (pytest-timeout);
# a worker that dies is not replaced (pytest-xdist's replacement under loadfile can wait for ever).
# Bytecode is cached (PYTHONDONTWRITEBYTECODE cleared): the suite starts many Python processes.
# schemathesis' and hypothesis' pytest plugins are off: tests/test_serve.py calls the two libraries
# themselves, not their plugins, and each plugin's import costs ~1 s.
PYTEST := OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n auto \
	--dist loadfile --max-worker-restart=0 --timeout=300 -p no:schemathesis -p no:hypothesispytest
test: venv $(VENV)/.llama
	SHAKESPEARE_TXT=$(abspath $(SHAKESPEARE_TXT)) $(PYTEST) tests

# the tests that run in pytest's own process, for the edit loop: not those marked `process` (a
# torchrun, a signal, a server, a fresh interpreter) or `slow` (pyproject.toml)
test-fast: venv
	$(PYTEST) -m "not process and not slow" tests

# llama-cpp-python, built from source once (tests/test_gguf.py runs llama.cpp on hf.py's GGUF files):
# the library only, without llama.cpp's multimodal library (LLAVA_BUILD=OFF), tests, examples, tools,
# server and app (already off when llama.cpp is built inside llama-cpp-python, said here to stay so),
# for this machine's CPU (GGML_NATIVE)
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON
$(VENV)/.llama: requirements-llama.txt $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --quiet -r requirements-llama.txt
	touch $@

# ruff (pinned in requirements-dev.txt; settings in pyproject.toml): lint, and the format check
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) out-shakespeare-char out-shakespeare-char-cpu out-shakespeare-char-fast
