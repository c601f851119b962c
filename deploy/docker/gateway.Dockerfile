# syntax=docker/dockerfile:1
# The gateway image: aiohttp and the gateway's own dependencies, no torch (the gateway never
# imports it; the encoder backend has an image of its own, encoder.Dockerfile). Build from the
# repository root; gateway.Dockerfile.dockerignore keeps the context to what is copied:
#
#   docker build -f deploy/docker/gateway.Dockerfile -t modality-gateway:0.1.0 .
#   docker run --rm -p 8080:8080 -v "$PWD/routing.yaml:/etc/modality-gateway/routing.yaml:ro" \
#     modality-gateway:0.1.0      # routing.yaml must say server.host: 0.0.0.0 in a container
#
# It runs as uid 10001 and writes nothing outside /tmp, so it runs with a read-only root
# filesystem (deploy/k8s mounts an emptyDir at /tmp). tests/test_k8s.py checks this file.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway/ gateway/
# The gateway's dependencies, the `video` extra (PyAV, whose wheel ships FFmpeg: video served as
# frames or pre-sampled) and the `tracing` extra (OpenTelemetry: server.tracing), not the
# `encoder` extra (torch). backends/ is not copied, so the image holds no encoder code either.
RUN python -m venv /opt/venv && /opt/venv/bin/pip install '.[video,tracing]'

FROM python:${PYTHON_VERSION}-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/venv /opt/venv
WORKDIR /tmp
# numeric, so that Kubernetes' runAsNonRoot can check it without /etc/passwd
USER 10001:10001
# 8080: server.port (/v1/*, /healthz, /readyz); 9090: server.admin_listen (/metrics, /admin/*)
EXPOSE 8080 9090
# exec form: SIGTERM reaches the gateway itself, which drains (docs/reliability.md), not a shell
ENTRYPOINT ["modality-gateway", "serve"]
CMD ["--config", "/etc/modality-gateway/routing.yaml"]
