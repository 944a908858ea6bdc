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
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install ".[sandbox]"

# The service runs as root in its container so that it can mount each session's quota tmpfs and
# overlay and make its cgroups; every sandboxed command runs as the unprivileged uid 61000
# (CRUCIBLE_SANDBOX_UID) with no capabilities. Without mount rights it falls back to copied workspaces.
USER root
EXPOSE 8080
CMD ["python", "-m", "services.sandbox"]
