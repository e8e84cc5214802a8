# One image for every service; compose picks the module to run.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY services ./services
COPY scripts ./scripts
RUN pip install .
USER nobody
CMD ["python", "-m", "services.gateway"]
