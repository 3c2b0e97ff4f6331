# syntax=docker/dockerfile:1
# spotrl-control: the control plane, `spotrl serve` (API) and `spotrl scheduler`, on CPU nodes.
# No torch: `pip install .` takes only pyproject.toml's core dependencies (the data plane's come
# with the [trainer] extra), and trainer_core is not copied in at all, so the image cannot import
# the trainer even by accident. Built from the repository root: `make image-control`.
#
# The base is pinned by its full tag (Python patch release and Debian release). Pin it by digest
# too when building for production: `make image-control PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:...`
# with the digest your registry mirror reports; this repository cannot resolve one offline.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/spotrl
WORKDIR /src
COPY pyproject.toml README.md ./
COPY contracts contracts
COPY services services
RUN /opt/spotrl/bin/pip install --no-cache-dir .

FROM ${PYTHON_IMAGE}
# A fixed numeric UID/GID, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --gid 10001 spotrl \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin spotrl
COPY --from=build /opt/spotrl /opt/spotrl
ENV PATH=/opt/spotrl/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPOTRL_HOME=/home/spotrl/.spotrl
USER 10001:10001
WORKDIR /home/spotrl
EXPOSE 8000
ENTRYPOINT ["spotrl"]
# `spotrl serve` refuses a non-loopback address without a tokens file; the Helm chart mounts one.
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
