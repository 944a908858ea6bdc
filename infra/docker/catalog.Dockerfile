# Crucible catalog service: task sets, tasks, sampling and curriculum over PostgreSQL and the object store.
# Build from the repository root: docker build -f infra/docker/catalog.Dockerfile .
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
RUN pip install ".[catalog]"

USER crucible
EXPOSE 8080
CMD ["python", "-m", "services.catalog"]
