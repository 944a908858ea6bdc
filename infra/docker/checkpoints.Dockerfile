# Crucible checkpoints service: weight versions: manifests, full snapshots, deltas, retention.
# Build from the repository root: docker build -f infra/docker/checkpoints.Dockerfile .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin crucible
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install ".[checkpoints]"

USER crucible
EXPOSE 8080
CMD ["python", "-m", "services.checkpoints"]
