# Crucible api service: run history over REST; also the image of the one-shot steps (migrations, bus
# identities and stream setup).
# Build from the repository root: docker build -f infra/docker/api.Dockerfile .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin crucible \
    && install -d -o crucible -m 0700 /var/lib/crucible/identities
ENV CRUCIBLE_MIGRATIONS_DIR=/app/migrations
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY migrations ./migrations
RUN pip install ".[api]"

USER crucible
EXPOSE 8000 8080
CMD ["python", "-m", "services.api"]
