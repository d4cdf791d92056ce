# Every target sets up .venv itself on first use (torch pinned to the local CPU wheel 2.13.0;
# on GPU/NPU machines install your own torch build first: setup.py only asks for torch>=2.6).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hyperacc-installed
DOCS_STAMP := $(VENV)/.hyperacc-docs-installed

.PHONY: demo lint test test-all bench rehearse docs

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile torch==2.13.0 -e ".[test]"   # one resolve
	# Byte-compiled here, on every core (pip compiles on one: 79 s of the install vs 72): processes cannot
	# write their own caches where PYTHONDONTWRITEBYTECODE is set. A file that does not compile is skipped.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# A tiny Qwen3-MoE on 2 CPU processes, offline; its metrics, final checkpoint and resolved config go to a new
# runs/demo-<time>/ each time (tests/test_demo_output.py runs these flags).
DEMO_RUN := runs/demo-$(shell date +%Y%m%d-%H%M%S)
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml examples/train_qwen.py \
		--checkpoint.save_ckpt=true --checkpoint.checkpoint_dir=$(DEMO_RUN) --logging.metrics_file=$(DEMO_RUN)/metrics.jsonl

lint: $(STAMP)   # the layers contract (.importlinter): a module imports only its own layer or a lower one
	$(VENV)/bin/lint-imports --no-cache

# Files on 2 pytest-xdist workers (TEST_WORKERS=0: one process); a file's tests stay on one worker.
TEST_WORKERS ?= 2
PYTEST = HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP) lint
	$(PYTEST) tests

test-all: $(STAMP) lint   # also the slow set: every layout and resume case (~2x longer)
	HYPERACC_SLOW_TESTS=1 $(PYTEST) tests

bench: $(STAMP)
	for b in overhead dataloader checkpoint data train accelerate_compat parallel weights context_parallel memory_plan precision replica_guard peft compile trainer sft_data iterable preflight architecture step_hooks libraries_weights libraries_data streaming; do $(PY) benchmarks/$$b.py || exit 1; done

rehearse: $(STAMP)   # Qwen3-30B-A3B at true width (1 layer) on 8 CPU processes: EP 8 and FSDP 8, save + bitwise resume
	HF_HUB_OFFLINE=1 $(PY) examples/rehearse_30b.py

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)   # the site under build/site; reference pages generated from the code (docs/gen_reference.py)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
