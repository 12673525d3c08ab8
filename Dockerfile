# syntax=docker/dockerfile:1
# gengate CPU image: the server, the Python client, llama.cpp and the remote-provider SDKs.
#   docker build -t gengate .
#   docker run -p 50051:50051 gengate                                   # embedded default: the tiny model
#   docker run -p 50051:50051 -v $PWD/gengate.yaml:/etc/gengate/gengate.yaml:ro \
#     -e OPENAI_API_KEY gengate --config /etc/gengate/gengate.yaml
# Add the transformers engine (pulls torch: about +1 GB):  --build-arg EXTRAS=llamacpp,providers,transformers
# Add the MLX engine (mlx-lm on MLX's CPU build, with transformers):  --build-arg EXTRAS=llamacpp,providers,mlx
# The GPU image with vLLM is a separate stack: bench/gpu/Dockerfile.vllm.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: compile llama-cpp-python once, then install everything into a venv -------------
FROM ${PYTHON_IMAGE} AS builder
ARG LLAMA_CPP_VERSION=0.3.36
ARG EXTRAS=llamacpp,providers
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# PyPI has only an sdist of llama-cpp-python; GGML_NATIVE=OFF keeps the binary portable across CPUs.
RUN CMAKE_ARGS="-DGGML_NATIVE=OFF" pip wheel --no-deps "llama-cpp-python==${LLAMA_CPP_VERSION}" -w /wheels
RUN python -m venv /opt/gengate
ENV PATH=/opt/gengate/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server server
COPY clients/python clients/python
RUN pip install --find-links /wheels ./clients/python ".[${EXTRAS}]" \
    && python -c "import gengate.cli, gengate.api.server, gengate_client, gengate_proto.v1.generation_pb2, grpc_health.v1.health" \
    && if echo ",${EXTRAS}," | grep -q ",llamacpp,"; then python -c "import llama_cpp"; fi
# The per-call hot paths compiled to C with mypyc (README "Performance"); mypy is needed only here.
RUN pip install "mypy==2.4.1" && gengate compile && pip uninstall -y mypy \
    && python -c "import gengate.compiled as c; print(c.status()); assert c.fresh_modules() == frozenset(c.MODULES)"

# ---- runtime: no compilers, non-root, the tiny model prebuilt ----------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gengate" \
      org.opencontainers.image.description="One gRPC service for text and typed structured output from any LLM" \
      org.opencontainers.image.licenses="Apache-2.0"
# libgomp1: llama.cpp's CPU backend uses OpenMP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libstdc++6 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 gengate \
    && useradd --system --uid 10001 --gid gengate --home-dir /home/gengate --create-home gengate \
    && mkdir -p /etc/gengate /var/cache/gengate \
    && chown gengate:gengate /var/cache/gengate
COPY --from=builder /opt/gengate /opt/gengate
COPY deploy/docker/healthcheck.py /usr/local/bin/gengate-healthcheck
ENV PATH=/opt/gengate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GENGATE_CACHE=/var/cache/gengate \
    GENGATE_PLACEMENT_FILE=/tmp/gengate-placement.json
USER 10001:10001
WORKDIR /home/gengate
# Build the tiny model into the image, so a read-only root filesystem still serves the default.
RUN python -c "from gengate.models.tiny import build_tiny_model, default_tiny_dir; build_tiny_model(default_tiny_dir())"
EXPOSE 50051
# grpc.health.v1 Check on service "" (Kubernetes uses its native grpc probe instead).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/usr/local/bin/gengate-healthcheck", "--address", "127.0.0.1:50051"]
# Config: mount a file and add `--config /etc/gengate/gengate.yaml`; with none, the embedded default.
ENTRYPOINT ["gengate", "serve", "--host", "0.0.0.0", "--port", "50051"]
