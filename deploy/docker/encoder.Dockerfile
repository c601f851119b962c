# syntax=docker/dockerfile:1
# The vision encoder backend (backends/vision_encoder) on a CUDA PyTorch base. Build from the
# repository root; encoder.Dockerfile.dockerignore keeps the context to what is copied:
#
#   docker build -f deploy/docker/encoder.Dockerfile -t modality-gateway-encoder:0.1.0 .
#   docker run --rm --gpus all -p 9001:9001 \
#     -v /srv/models/Qwen2.5-VL-7B-Instruct:/models/vision:ro modality-gateway-encoder:0.1.0
#
# Model weights come from a mounted volume, read offline: nothing is downloaded at start (the
# backend reads local directories only, and HF_HUB_OFFLINE makes sure of it). The default command
# reads the checkpoint mounted at /models/vision and fails at once without it; pass
# `--model builtin:vit-small` for the random demo tower.
#
# TORCH_VERSION must equal the `torch==` pin of pyproject.toml's `encoder` extra: pip then keeps
# the base's torch instead of downloading another one of several GB (tests/test_k8s.py checks it).
# Check that the tag exists for your CUDA driver before building (the tags are
# TORCH-cudaX.Y-cudnnN-runtime).
ARG TORCH_VERSION=2.13.0
ARG CUDA_TAG=cuda13.0-cudnn9

FROM pytorch/pytorch:${TORCH_VERSION}-${CUDA_TAG}-runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HOME=/tmp
WORKDIR /src
COPY pyproject.toml README.md ./
# backends/ imports gateway.errors (one error shape for both), so both packages are installed
COPY gateway/ gateway/
COPY backends/ backends/
RUN pip install '.[encoder]' && rm -rf /src
WORKDIR /tmp
USER 10001:10001
EXPOSE 9001
# exec form: SIGTERM reaches the backend, which stops listening and finishes its requests
ENTRYPOINT ["python", "-m", "backends.vision_encoder", "serve"]
CMD ["--host", "0.0.0.0", "--port", "9001", "--device", "auto", "--model", "/models/vision"]
