# One image for every service; compose picks the module to run. It also
# carries nats-server (a dependency, for `make run`) and the Ollama stand-in.
#
# BASE_IMAGE: any Debian-like image with python3 (3.11+) and its venv module.
# Without a registry, scripts/docker_base.sh makes one from Debian packages.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# WHEELS_ONLY=1: install from wheels/ alone (see wheels/README), not PyPI.
ARG WHEELS_ONLY=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python3 -m venv /opt/chat
COPY wheels /wheels
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY services ./services
COPY scripts ./scripts
RUN /opt/chat/bin/pip install --quiet --find-links /wheels ${WHEELS_ONLY:+--no-index} . \
 && /opt/chat/bin/pip uninstall --quiet --yes pip setuptools

# Only the virtual environment moves on: no pip, no sources, no build tools.
FROM ${BASE_IMAGE}
ENV PATH=/opt/chat/bin:$PATH PYTHONUNBUFFERED=1
COPY --from=build /opt/chat /opt/chat
COPY nats.conf /etc/nats/nats.conf
# /data: a NATS store when this image runs nats-server; a named volume
# mounted there starts out owned by the service's user.
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin chat \
 && mkdir /data && chown chat /data
USER chat
WORKDIR /tmp
CMD ["python", "-m", "services.gateway"]
