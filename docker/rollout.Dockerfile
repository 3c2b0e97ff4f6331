# syntax=docker/dockerfile:1
# spotrl-rollout: the rollout worker (`spotrl worker`, started by the launcher) on spot A10G/L4
# GPUs, with vLLM. Built from the repository root: `make image-rollout`.
#
# torch comes from PyPI (its CUDA wheels bundle the CUDA runtime libraries), so a runtime CUDA
# base is enough; vLLM 0.30-0.32 are the releases built for torch 2.13.0 (pyproject.toml [gpu]).
# The base is pinned by its full tag (CUDA release, cuDNN flavour, Ubuntu release); pin it by
# digest too for production with CUDA_IMAGE=nvidia/cuda:...@sha256:..., as resolved by your mirror.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE}
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# Ubuntu's python3 (3.12): versions follow the pinned base image, hence no apt pins.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 spotrl \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin spotrl \
    && python3 -m venv /opt/spotrl
WORKDIR /src
COPY pyproject.toml README.md ./
COPY contracts contracts
COPY services services
COPY trainer_core trainer_core
# torch first, at the project's pin, so that no other requirement can move it.
RUN /opt/spotrl/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && /opt/spotrl/bin/pip install --no-cache-dir ".[trainer,gpu]" \
    && rm -rf /src
ENV PATH=/opt/spotrl/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/spotrl/.cache/huggingface \
    SPOTRL_HOME=/home/spotrl/.spotrl
USER 10001:10001
WORKDIR /home/spotrl
ENTRYPOINT ["spotrl"]
CMD ["--help"]
