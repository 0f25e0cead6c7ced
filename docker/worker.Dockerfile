# syntax=docker/dockerfile:1
# An autotune probe worker: `autotune worker` on an official PyTorch CUDA runtime image, with the
# `probe` and `hf` extras installed around the image's own torch (never a second torch build).
#
#   docker build -f docker/worker.Dockerfile -t autotune-worker:local .
#   docker run --init --gpus all -e AUTOTUNE_TOKEN=... autotune-worker:local \
#     autotune worker --server http://SERVER:8000 --device cuda:0
#
# Newer GPUs or drivers may want another CUDA build: --build-arg BASE_IMAGE=pytorch/pytorch:TAG
# (any *-runtime tag with torch >= 2.5). Build context: the repository root.

ARG BASE_IMAGE=pytorch/pytorch:2.10.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# `utility` makes the NVIDIA runtime mount libnvidia-ml: the worker reads capacity through NVML.
# PCI_BUS_ID numbers GPUs as nvidia-smi does (CUDA's default is fastest first), so that
# `--device cuda:N` is the GPU nvidia-smi lists as N.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUDA_DEVICE_ORDER=PCI_BUS_ID

RUN groupadd --system --gid 10001 autotune \
    && useradd --system --uid 10001 --gid autotune --create-home autotune

WORKDIR /src

# Dependencies first (core + `probe` + `hf`, read from pyproject.toml), in their own layer. The
# constraint pins torch to the version already in the base image: `torch>=2.5` is then
# satisfied as it is, and no resolver path can swap in a CPU wheel or another CUDA build.
COPY pyproject.toml README.md ./
RUN python -c "import importlib.metadata, tomllib; \
p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; \
open('/tmp/constraints.txt', 'w').write('torch==%s\n' % importlib.metadata.version('torch')); \
open('/tmp/requirements.txt', 'w').write('\n'.join(p['dependencies'] + x['probe'] + x['hf']))" \
    && pip install --no-cache-dir -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY autotune ./autotune
COPY api ./api
COPY probes ./probes
RUN pip install --no-cache-dir --no-deps -c /tmp/constraints.txt . \
    && python -c "import torch, autotune.cli.main; assert torch.version.cuda, 'torch lost its CUDA build'" \
    && cd / && rm -rf /src /tmp/constraints.txt

USER autotune
WORKDIR /home/autotune
# Models built from hub ids fetch their configs here (the user's home, writable).
ENV HF_HOME=/home/autotune/.cache/huggingface

# The server URL and token come from AUTOTUNE_SERVER and AUTOTUNE_TOKEN unless given as flags.
CMD ["autotune", "worker", "--device", "cuda"]
