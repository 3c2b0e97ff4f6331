# syntax=docker/dockerfile:1
# spotrl-training: one training iteration (`spotrl train-job RUN ITERATION`, started by the
# launcher as a Kubernetes Job, under torchrun for several ranks) on on-demand A100/H100 GPUs,
# with DeepSpeed. Built from the repository root: `make image-training`.
#
# A devel CUDA base, because DeepSpeed compiles its CUDA ops with nvcc: FusedAdam and CPUAdam are
# built here, for A100 (sm_80) and H100 (sm_90), instead of being JIT-compiled for minutes on
# every fresh on-demand node. Keep the base's CUDA major release equal to torch's wheels' (12.x).
# The base is pinned by its full tag; pin it by digest too for production with
# CUDA_IMAGE=nvidia/cuda:...@sha256:..., as resolved by your mirror.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

FROM ${CUDA_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# Ubuntu's python3 (3.12) and a C++ toolchain for DeepSpeed's op builds: versions follow the
# pinned base image, hence no apt pins.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv build-essential ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 spotrl \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin spotrl \
    && python3 -m venv /opt/spotrl
WORKDIR /src
COPY pyproject.toml README.md ./
COPY contracts contracts
COPY services services
COPY trainer_core trainer_core
# torch first, at the project's pin; then spotrl with DeepSpeed built against that torch (its
# op builds import torch, hence --no-build-isolation and setuptools/wheel in the venv).
RUN /opt/spotrl/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" "setuptools>=68" wheel \
    && DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
       /opt/spotrl/bin/pip install --no-cache-dir --no-build-isolation ".[trainer,deepspeed]" \
    && rm -rf /src
ENV PATH=/opt/spotrl/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/spotrl/.cache/huggingface \
    TORCH_EXTENSIONS_DIR=/home/spotrl/.cache/torch_extensions \
    SPOTRL_HOME=/home/spotrl/.spotrl
USER 10001:10001
WORKDIR /home/spotrl
ENTRYPOINT ["spotrl"]
CMD ["--help"]
