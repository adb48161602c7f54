# syntax=docker/dockerfile:1
# shardserve container image: the HTTP QA server (`shardserve serve`) on the embedded default model.
#
#   docker build -t shardserve:cpu .                                 # small CPU image (default)
#   docker build -t shardserve:cuda --build-arg VARIANT=cuda .       # CUDA torch wheels, device=cuda
#   docker run -p 8000:8000 shardserve:cpu                           # serves on http://127.0.0.1:8000
#   docker run -p 8000:8000 -e SHARDSERVE_PP=2 shardserve:cpu        # every flag: SHARDSERVE_<FLAG>
#
# Stages: `builder` installs torch (CPU or CUDA wheels by VARIANT) and the project into a virtual
# environment; `runtime` copies only that environment onto a slim Python image and runs as a
# non-root user. The CUDA variant needs the NVIDIA container toolkit on the host (`--gpus all`);
# the CUDA libraries come with the torch wheels, so both variants share the same base image.
# Linted in CI by hadolint (tests/deploy/test_dockerfile.py).

ARG PYTHON_VERSION=3.11
ARG VARIANT=cpu

FROM python:${PYTHON_VERSION}-slim AS builder
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# torch first, from the wheel index of the variant (CPU wheels are ~5x smaller than CUDA ones)
RUN if [ "$VARIANT" = "cpu" ]; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX}"; \
    elif [ "$VARIANT" = "cuda" ]; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    else \
        echo "VARIANT=${VARIANT}: must be cpu or cuda" >&2; exit 2; \
    fi
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY models ./models
COPY partitioner ./partitioner
COPY serving ./serving
COPY training ./training
COPY loadtest ./loadtest
COPY shardserve ./shardserve
# the project itself (not editable); torch is already satisfied, so no other torch is pulled
RUN pip install --no-cache-dir /src && python -c "import shardserve.cli, shardserve.models.registry"

FROM python:${PYTHON_VERSION}-slim AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="shardserve" \
      org.opencontainers.image.description="Model-parallel extractive question-answering server" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 shardserve \
    && useradd --system --uid 10001 --gid shardserve --create-home --home-dir /home/shardserve shardserve
COPY --from=builder /opt/venv /opt/venv
# multi-host rendezvous check run by deploy/gang-two-hosts.yaml
COPY deploy/gang_probe.py /opt/shardserve/gang_probe.py
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    SHARDSERVE_CACHE=/home/shardserve/.cache/shardserve \
    SHARDSERVE_HOST=0.0.0.0 \
    SHARDSERVE_PORT=8000 \
    SHARDSERVE_DEVICE=${VARIANT}
USER 10001:10001
WORKDIR /home/shardserve
# 8000: HTTP; 8001: KServe v2 / Triton gRPC when SHARDSERVE_GRPC_PORT=8001 (or --grpc-port 8001) is set
EXPOSE 8000 8001
# liveness of the process (not readiness: /readyz is for load balancers and Kubernetes)
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SHARDSERVE_PORT', '8000'), timeout=4)"]
# SIGTERM: readiness -> 503, admitted requests finish (SHARDSERVE_DRAIN_TIMEOUT_S), exit 0
STOPSIGNAL SIGTERM
ENTRYPOINT ["shardserve"]
CMD ["serve"]
