# The default demo: the gateway and its 8 simulated GPU engines in one container.
#   docker build -t heterogate . && docker run --rm -p 8000:8000 heterogate
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto proto
COPY gateway gateway
COPY backends backends
COPY configs configs
RUN pip install --no-cache-dir -e .
EXPOSE 8000 50061
CMD ["gateway", "--backends", "configs/backends.yaml", "--host", "0.0.0.0", "--port", "8000"]
