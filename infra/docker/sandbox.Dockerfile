# Crucible sandbox service: isolated workspaces (bubblewrap) and the agent's tools.
# Build from the repository root: docker build -f infra/docker/sandbox.Dockerfile .
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap ripgrep git \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin crucible
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install ".[sandbox]"

USER crucible
EXPOSE 8080
CMD ["python", "-m", "services.sandbox"]
