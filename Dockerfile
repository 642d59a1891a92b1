# syntax=docker/dockerfile:1
#
# llama-router with llama.cpp's llama-server and web UI in one image (docs/deployment.md).
#
#   docker build -t llama-router .
#   docker run --rm -p 127.0.0.1:8080:8080 -v "$PWD/presets:/etc/llama-router:ro" \
#       -v /srv/models:/models:ro llama-router --presets /etc/llama-router/models.ini
#
# llama-server is taken from the official llama.cpp server image, pinned to one build. The tag
# MUST match the flags your presets use: preset keys are checked against this binary's --help,
# and b11434 is the build the router is tested against (router/llama/install.py,
# tests/data/llama-server-help.txt). Change the tag and the build number together, and prefer a
# digest (`...:server-b11434@sha256:...`) for reproducible builds. Variants of the same build:
#   server-b11434         CPU (all x86-64/arm64 variants, picked at run time)
#   server-cuda-b11434    NVIDIA CUDA (compose.gpu.yaml)
#   server-vulkan-b11434  Vulkan
ARG LLAMA_CPP_IMAGE=ghcr.io/ggml-org/llama.cpp:server-b11434
# Debian 13: its glibc (2.41) is newer than that of llama.cpp's Ubuntu 24.04 images (2.39), which
# the copied binaries need.
ARG PYTHON_IMAGE=python:3.12-slim-trixie

FROM ${LLAMA_CPP_IMAGE} AS llama

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
RUN python -m venv /opt/llama-router \
    && /opt/llama-router/bin/pip install --no-cache-dir .

# llama.cpp's web UI (tools/ui of the same b11434 source, the PyPI sdist), served by the router at
# /. Built by the router's own installer (--webui-only: llama-server comes from the image above)
# with Debian's Node.js (20.19, the least the UI's bundler accepts) and npm; only the static files
# reach the final image. A failed UI build fails the image build.
FROM build AS webui
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends nodejs npm \
    && rm -rf /var/lib/apt/lists/* \
    && XDG_CACHE_HOME=/tmp/cache /opt/llama-router/bin/llama-router install-llama-server \
        --webui-only \
    && mv /tmp/cache/llama-router/llama-server/b*/webui /opt/webui \
    && test -f /opt/webui/index.html

FROM ${PYTHON_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# llama-server and its libraries stay together in one directory: llama.cpp's backends
# (libggml-cpu-*.so, libggml-cuda.so, ...) are loaded at run time from the executable's own
# directory, and a backend whose libraries are missing is skipped without an error, so every
# library is checked here. From a CUDA image, the CUDA runtime libraries come along; the driver
# (libcuda.so.1) is mounted by the NVIDIA container toolkit at run time. System packages:
# libgomp1 (OpenMP, CPU backend) always, the Vulkan loader for a Vulkan image.
# hadolint ignore=DL3008
RUN --mount=type=bind,from=llama,source=/app,target=/mnt/llama-app \
    --mount=type=bind,from=llama,source=/usr/local,target=/mnt/llama-local \
    set -eu; \
    mkdir -p /opt/llama.cpp; \
    cp -a /mnt/llama-app/. /opt/llama.cpp/; \
    for lib in /mnt/llama-local/cuda-*/targets/*/lib; do \
        if [ -d "$lib" ]; then \
            cp -P "$lib"/libcudart.so* "$lib"/libcublas.so* "$lib"/libcublasLt.so* /opt/llama.cpp/; \
        fi; \
    done; \
    packages=(libgomp1); \
    if [ -e /opt/llama.cpp/libggml-vulkan.so ]; then packages+=(libvulkan1 mesa-vulkan-drivers); fi; \
    apt-get update; \
    apt-get install -y --no-install-recommends "${packages[@]}"; \
    rm -rf /var/lib/apt/lists/*; \
    echo /opt/llama.cpp > /etc/ld.so.conf.d/llama-cpp.conf; \
    ldconfig; \
    ln -s /opt/llama.cpp/llama-server /usr/local/bin/llama-server; \
    missing=$(for f in /opt/llama.cpp/llama-server /opt/llama.cpp/*.so; do ldd "$f"; done \
              | grep 'not found' | grep -v 'libcuda\.so' | sort -u || true); \
    if [ -n "$missing" ]; then echo "missing libraries:"; echo "$missing"; exit 1; fi; \
    llama-server --version

COPY --from=build /opt/llama-router /opt/llama-router
COPY --from=webui /opt/webui /opt/llama-router/webui

RUN groupadd --system --gid 10001 llama \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/llama \
        --shell /usr/sbin/nologin llama \
    && mkdir -p /data/huggingface /etc/llama-router /models \
    && chown -R llama:llama /data

# LLAMA_ROUTER_HOST: inside a container the router must listen on every interface; publish the
# port on 127.0.0.1 on the host (compose.yaml) or put an API key in front of it.
ENV PATH=/opt/llama-router/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LLAMA_ROUTER_HOST=0.0.0.0 \
    LLAMA_ROUTER_PORT=8080 \
    LLAMA_SERVER_BIN=/usr/local/bin/llama-server \
    LLAMA_ROUTER_WEBUI_PATH=/opt/llama-router/webui \
    HF_HOME=/data/huggingface

USER 10001:10001
WORKDIR /home/llama
EXPOSE 8080

# /health answers {"status":"ok"} without an API key. No curl in the slim image: Python's urllib
# exits non-zero on a connection error or a non-2xx status.
HEALTHCHECK --interval=30s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('LLAMA_ROUTER_PORT', '8080') + '/health', timeout=4)"]

# Settings come from LLAMA_ROUTER_* variables or flags appended to `docker run ... IMAGE`;
# arguments after `--` go to every llama-server child.
ENTRYPOINT ["llama-router", "serve"]
