FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY limiter limiter
COPY worker worker
COPY lua lua
# torch with CUDA for GPU workers; frontends and controllers do not import it.
RUN pip install --no-cache-dir '.[worker]'
EXPOSE 8000
CMD ["qos", "--help"]
