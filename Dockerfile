# syntax=docker/dockerfile:1
# megatron_zcpo for H100 clusters: training (megatron-core + Transformer Engine + apex) and rollout
# (SGLang + sglang-router) in one image. Build from the repository root:
#     docker build -t megatron-zcpo .
#     enroot import -o megatron-zcpo.sqsh dockerd://megatron-zcpo   # for srun --container-image (pyxis)
# Not built on the development machines (no Docker engine, no GPU): every pin below was read from
# the projects' release notes and package metadata, and the build prints what it got (last step).

# ---------------------------------------------------------------------------------------------
# Base: NGC PyTorch 25.12. Its release notes ("PyTorch Release 25.12") and the versions reported
# from inside the image: CUDA 13.1.0, PyTorch 2.10.0a0+b4e4ee81d3 (NVIDIA build), Python 3.12.3
# (Ubuntu 24.04's system Python, packages in /usr/local/lib/python3.12/dist-packages),
# Transformer Engine 2.10.0, NVIDIA apex, NCCL 2.28.9, cuDNN 9.17.0, flash-attn 2.7.4.post1.
# Why this tag: the newest release whose contents we could confirm, with TE + apex built against
# its own torch (a pip torch would break both), Python 3.12.
# CUDA 13.1 needs an R580 or newer driver on the nodes (NGC's forward-compatibility layer covers
# some older data-center branches; see the release notes' driver section). For an R570 cluster,
# build with --build-arg BASE_IMAGE=<a CUDA 12.9 NGC PyTorch tag> instead.
# Since 25.03 the image ships /etc/pip/constraint.txt pinning every package it was built with;
# the installs below honour it, so pip fails rather than replace torch, TE or apex.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PIP_CONSTRAINT=/etc/pip/constraint.txt

# The torch the image came with; the last step checks that nothing replaced it.
RUN python -c "import torch; print(torch.__version__)" > /opt/base-torch-version

# bubblewrap: the code tool's sandbox (tools.registry.*.kind: code runs model-written code under it;
# Ubuntu 24.04's package, 0.9.0). Inside a container it needs new namespaces: Docker's default seccomp
# profile refuses them (docker run --security-opt seccomp=unconfined); enroot/pyxis containers allow them.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
# megatron-core 0.16.1: the release the whole test suite runs on (megatron_zcpo/megatron/compat.py
# lists every megatron-core internal we use and checks them; the last step below runs that check).
# 0.16.1 declares Python >= 3.10 (3.12 included) and transformer-engine >=2.9,<2.12, which the
# base's TE 2.10 meets. 0.19.2 (Python >= 3.12 only) was read against our code: it removes
# dist_checkpointing.strategies.base and ignores custom save strategies, which breaks
# checkpoint conversion (convert/checkpoint.py); compat.py's notes list the rest. Build with
# --build-arg MCORE_VERSION=<other> only together with a compat.py that passes on it.
ARG MCORE_VERSION=0.16.1
RUN pip install "megatron-core==${MCORE_VERSION}"

# nvidia-modelopt (FP8 rollouts: quantise the pushed policy weights). NGC PyTorch images carry
# their own modelopt, tested with their torch; install 0.47.0 (needs torch>=2.8; the newest the
# package's dev extra admits, <0.48) only when the base has none.
ARG MODELOPT_VERSION=0.47.0
RUN python -c "import modelopt" 2>/dev/null || pip install "nvidia-modelopt==${MODELOPT_VERSION}"

# ---------------------------------------------------------------------------------------------
# SGLang in its own virtual environment: the newest tested pair of docs/SGLANG.md (the tested range
# is 0.5.3.post3 .. 0.5.23, sglang-router 0.2.0 .. 0.3.2; setup.py's sglang extra admits exactly it).
# sglang 0.5.23 pins torch==2.14.1 (CUDA 13 wheels), transformers==5.19.0 and
# flashinfer_python[cu13]==0.7.2 exactly; installing it next to the base's torch 2.10.0a0 would
# replace that torch (and break TE and apex, compiled against it). The servers are separate
# processes that only talk HTTP and NCCL with the trainer, so /opt/sglang holds SGLang with its own
# PyPI torch (CUDA 13, like the base's CUDA 13.1, so flashinfer's JIT uses a matching nvcc).
#   sglang 0.5.23: weight pushes inside /begin_weight_update .. /end_weight_update sessions (the
#     client opens them on servers that report 0.5.21 or newer), routed experts for routing replay,
#     --quantization modelopt_fp8 for FP8 rollouts.
#   sglang-router 0.3.2: the newest sglang-router (its successor package is smg); its launch_router
#     takes the --worker-urls/--policy/--host/--port/--request-timeout-secs/--api-key that
#     rollout/sglang/server.py:router_command passes (CI runs that very line on CPU).
#   nvidia-nccl-cu13 2.28.9: the weight push puts trainer rank 0 (the base's NCCL 2.28.9) and
#     every SGLang worker into one NCCL communicator, so the venv gets the same NCCL release as
#     the base (same libnccl.so.2 ABI, loaded at run time). Build with SGLANG_NCCL_VERSION="" to
#     keep torch's, and use rollout.sglang.client.weight_sync=disk if the versions must differ.
#   uv builds the venv: the base's Debian-style Python has no ensurepip, and uv ignores the
#     base's pip constraints (which pin torch 2.10.0a0 and would block SGLang's torch).
# For the oldest supported release instead: --build-arg SGLANG_VERSION=0.5.3.post3
# --build-arg SGLANG_ROUTER_VERSION=0.2.0 --build-arg SGLANG_NCCL_PACKAGE=nvidia-nccl-cu12 (its
# torch 2.8.0 is a CUDA 12.8 build), or SGLang's own release image for the rollout nodes
# (SGLANG_CONTAINER_IMAGE, see examples/README.md).
ARG UV_VERSION=0.13.9
ARG SGLANG_VERSION=0.5.23
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG SGLANG_NCCL_PACKAGE=nvidia-nccl-cu13
ARG SGLANG_NCCL_VERSION=2.28.9
RUN PIP_CONSTRAINT= pip install "uv==${UV_VERSION}" \
 && uv venv --python "$(command -v python3)" /opt/sglang \
 && uv pip install --python /opt/sglang/bin/python "sglang==${SGLANG_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}" \
 && if [ -n "${SGLANG_NCCL_VERSION}" ]; then \
        uv pip install --python /opt/sglang/bin/python "${SGLANG_NCCL_PACKAGE}==${SGLANG_NCCL_VERSION}"; fi
ENV SGLANG_PYTHON=/opt/sglang/bin/python

# ---------------------------------------------------------------------------------------------
# This package, editable at /opt/megatron_zcpo (the examples' sbatch scripts mount a checkout
# there, so the image runs that checkout's code). setup.py's torch>=2.4 is met by the base's
# torch, which the constraint file pins: no torch is downloaded.
WORKDIR /opt/megatron_zcpo
COPY . /opt/megatron_zcpo
RUN pip install -e .

# What the image holds; fails the build if torch was replaced.
RUN python - <<'EOF'
import importlib.metadata as md
import torch
base = open("/opt/base-torch-version").read().strip()
assert torch.__version__ == base, f"torch changed from {base} to {torch.__version__}"
for name in ("torch", "transformer-engine", "apex", "megatron-core", "nvidia-modelopt", "megatron-zcpo"):
    try:
        print(f"{name:20s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name:20s} (not installed)")
print(f"{'CUDA':20s} {torch.version.cuda}")
EOF
# Every megatron-core internal the code relies on is present with the arguments it passes.
RUN python -m megatron_zcpo.megatron.compat
RUN /opt/sglang/bin/python -c "import importlib.metadata as md; \
print(*(f'{n} {md.version(n)}' for n in ('sglang', 'sglang-router', 'torch')), sep='\n')"
