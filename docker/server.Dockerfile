# syntax=docker/dockerfile:1
# The autotune API server: `autotune serve` with the `api` extra only. No torch, no CUDA: the
# server never runs a training step, so the image stays small and starts on any CPU box.
#
#   docker build -f docker/server.Dockerfile -t autotune-server:local .
#   docker run -p 8000:8000 -v autotune-data:/data \
#     -e AUTOTUNE_CLIENT_TOKENS=... -e AUTOTUNE_WORKER_TOKENS=... autotune-server:local
#
# Build context: the repository root (docker/server.Dockerfile.dockerignore keeps it small).

FROM python:3.12.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed uid, so a bind-mounted data directory can be chowned to it on the host.
RUN groupadd --system --gid 10001 autotune \
    && useradd --system --uid 10001 --gid autotune --create-home autotune

WORKDIR /src

# Dependencies first, in their own layer: read from pyproject.toml (core + the `api` extra), so
# that editing the code does not reinstall FastAPI and SQLAlchemy.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['api']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY autotune ./autotune
COPY api ./api
COPY probes ./probes
# The project itself, without touching the dependencies installed above.
RUN pip install --no-cache-dir --no-deps . \
    && cd / && rm -rf /src

# The SQLite database (the default when AUTOTUNE_DATABASE_URL is unset) lives in /data: mount a
# volume there. The directory belongs to the server user so that a fresh named volume does too.
ENV AUTOTUNE_DATA_DIR=/data
RUN mkdir -p /data && chown autotune:autotune /data
VOLUME ["/data"]
WORKDIR /data

USER autotune
EXPOSE 8000

# /health answers 200 only when the database answers too; urlopen raises (exit 1) on anything
# else. Python instead of curl: the slim image has no curl and needs none.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

CMD ["autotune", "serve", "--host", "0.0.0.0", "--port", "8000"]
