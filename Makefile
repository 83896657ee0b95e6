# Two commands on a fresh machine:
#   make quickstart   set up .venv with what running needs, prepare Shakespeare, train (CPU config, or the
#                     baby GPT on a GPU), sample; TRAIN_ARGS="--max_iters=100" passes train.py flags
#   make test         add the test tools to .venv (requirements-dev.txt) and run the suite
#   make test-fast    the tests that start no process of their own, in under 2 minutes
#   make lint         ruff check and ruff format --check, as CI runs them before make test
#   make chat-demo    docs/chat.md's chat demo from nothing: data, tokenizer, training (~70 s on 2 cores)
#   make rl-demo      docs/chat.md's RL demo from nothing: arithmetic problems, SFT, then scripts/chat_rl.py, pass@k before and after
# All keep a GPU build of torch (>= scripts/system_torch.py's floor) that python3 already has.
# SHAKESPEARE_TXT=/path/to/input.txt: tiny Shakespeare from there instead of data/shakespeare_char/input.txt
# or the download.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SHAKESPEARE_TXT ?=
TRAIN_ARGS ?=
RL_ARGS ?=

.PHONY: quickstart chat-demo rl-demo test test-fast lint venv venv-dev clean

venv: $(VENV)/.installed
venv-dev: $(VENV)/.installed-dev

# What running needs (requirements.txt), re-installed only when it changes. A GPU build of torch at
# or above the supported floor that $(PYTHON) already imports is the machine's own, matched to its
# driver: the venv sees it (--system-site-packages), pip installs the rest without torch and may
# not replace it (a constraint). Elsewhere, or with SYSTEM_TORCH=no, the venv gets the torch pinned
# in requirements.txt. pip prints what it fetches: the first install is minutes of downloads.
SYSTEM_TORCH ?= auto
$(VENV)/.installed: requirements.txt scripts/system_torch.py
	@if [ "$(SYSTEM_TORCH)" != no ] && version=$$($(PYTHON) scripts/system_torch.py); then \
		echo "make: installing what running needs (requirements.txt) into $(VENV) beside this machine's torch:" \
			"about 1.1 GB, a few minutes; make test adds the test tools"; \
		set -ex; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
		grep -v '^torch[=<>~ ]' requirements.txt > $(VENV)/requirements-without-torch.txt; \
		echo "torch==$$version" > $(VENV)/keep-torch.txt; \
		$(PY) -m pip install --quiet --upgrade pip; \
		$(PY) -m pip install -c $(VENV)/keep-torch.txt -r $(VENV)/requirements-without-torch.txt; \
	else \
		echo "make: installing what running needs (requirements.txt: torch for the CPU, numpy, ...) into" \
			"$(VENV): about 1.9 GB, a few minutes; make test adds the test tools"; \
		set -ex; \
		$(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install --quiet --upgrade pip; \
		$(PY) -m pip install -r requirements.txt; \
	fi
	touch $@

# What the tests need on top (requirements-dev.txt), under a constraint that keeps the venv's torch
$(VENV)/.installed-dev: requirements-dev.txt $(VENV)/.installed
	@echo "make: adding the test tools (requirements-dev.txt: pytest, ruff, the openai client, selenium, ...) to $(VENV):" \
		"about 0.1 GB"
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/keep-torch.txt
	$(PY) -m pip install -c $(VENV)/keep-torch.txt -r requirements-dev.txt
	touch $@

# --overwrite=True: a second make quickstart trains afresh over the first run's out_dir.
# On a GPU the fast baby GPT (config/train_shakespeare_char_fast.py), else the CPU config.
quickstart: venv
	$(PY) data/shakespeare_char/prepare.py $(if $(SHAKESPEARE_TXT),--input $(SHAKESPEARE_TXT))
	@if $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then name=fast; else name=cpu; fi; \
	set -e; \
	echo "$(PY) train.py config/train_shakespeare_char_$$name.py --overwrite=True $(TRAIN_ARGS)"; \
	$(PY) train.py config/train_shakespeare_char_$$name.py --overwrite=True $(TRAIN_ARGS); \
	echo "$(PY) sample.py --out_dir=out-shakespeare-char-$$name --num_samples=1 --max_new_tokens=500"; \
	$(PY) sample.py --out_dir=out-shakespeare-char-$$name --num_samples=1 --max_new_tokens=500; \
	echo; \
	echo "make quickstart is done: the run is in out-shakespeare-char-$$name. Next, in $(VENV) (. $(VENV)/bin/activate):"; \
	printf '  %-70s # %s\n' "python sample.py --out_dir=out-shakespeare-char-$$name --start=ROMEO:" "more samples" \
		"python plot.py out-shakespeare-char-$$name" "its loss curves, a PNG" \
		"make chat-demo" "a chat model, then chat.py and serve.py"; \
	echo "  README.md's walkthrough: every step above by hand, and what else it does"

# docs/chat.md's demo from nothing: synthetic conversations, a tokenizer trained on them, the token
# files, then config/chat_demo_cpu.py (--overwrite=True: a second make chat-demo trains afresh)
chat-demo: venv
	$(PY) data/chat/synthetic.py --out_dir=data/chat_demo --n=60000
	$(PY) data/train_tokenizer.py --input data/chat_demo/text.txt --vocab_size=512 --out_dir=data/chat_demo
	$(PY) data/chat/prepare.py --input data/chat_demo/train.jsonl --tokenizer=data/chat_demo/tokenizer.json \
		--out_dir=data/chat_demo --block_size=128
	$(PY) train.py config/chat_demo_cpu.py --overwrite=True $(TRAIN_ARGS)
	@echo
	@echo "make chat-demo is done: the model is in out-chat-demo. Talk to it, in $(VENV) (. $(VENV)/bin/activate):"
	@echo "  python chat.py --out_dir=out-chat-demo      # type 'My name is Dovaki.', then 'What is my name?'"
	@echo "  python serve.py --out_dir=out-chat-demo     # the chat page at http://127.0.0.1:8000/, OpenAI's API beside it"

# docs/chat.md's RL demo from nothing: generated arithmetic word problems as conversations, their
# tokenizer, SFT (config/rl_demo_sft_cpu.py), then scripts/chat_rl.py (config/rl_demo_cpu.py) and its reward curve
rl-demo: venv
	$(PY) data/chat/arithmetic.py --out_dir=data/rl_demo --n=20000
	$(PY) data/train_tokenizer.py --input data/rl_demo/text.txt --vocab_size=512 --out_dir=data/rl_demo
	$(PY) data/chat/prepare.py --input data/rl_demo/train.jsonl --tokenizer=data/rl_demo/tokenizer.json \
		--out_dir=data/rl_demo --block_size=64
	$(PY) train.py config/rl_demo_sft_cpu.py --overwrite=True $(TRAIN_ARGS)
	$(PY) scripts/chat_rl.py config/rl_demo_cpu.py --overwrite=True $(RL_ARGS)
	$(PY) plot.py out-rl-demo
	@echo
	@echo "make rl-demo is done: pass@k before RL (iter 0) and after are in out-rl-demo/metrics.jsonl, the curves in"
	@echo "out-rl-demo/metrics.png. Talk to it: python chat.py --out_dir=out-rl-demo --prompt='Ava has 3 apples. Ava gets 4 more and gives 2 away. How many apples does Ava have now?'"

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
test: venv-dev $(VENV)/.llama
	SHAKESPEARE_TXT=$(abspath $(SHAKESPEARE_TXT)) $(PYTEST) tests

# the tests that run in pytest's own process, for the edit loop: not those marked `process` (a
# torchrun, a signal, a server, a fresh interpreter) or `slow` (pyproject.toml)
test-fast: venv-dev
	$(PYTEST) -m "not process and not slow" tests

# llama-cpp-python, built from source once (tests/test_gguf.py runs llama.cpp on hf.py's GGUF files):
# the library only, without llama.cpp's multimodal library (LLAVA_BUILD=OFF), tests, examples, tools,
# server and app (already off when llama.cpp is built inside llama-cpp-python, said here to stay so),
# for this machine's CPU (GGML_NATIVE)
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON
$(VENV)/.llama: requirements-llama.txt $(VENV)/.installed-dev
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --quiet -r requirements-llama.txt
	touch $@

# ruff (pinned in requirements-dev.txt; settings in pyproject.toml): lint, and the format check
lint: venv-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) out-shakespeare-char out-shakespeare-char-cpu out-shakespeare-char-fast out-chat-demo data/chat_demo out-rl-demo out-rl-demo-sft data/rl_demo
