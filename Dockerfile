# The default demo: the gateway and its 8 simulated GPU engines in one container.
#   docker build -t heterogate . && docker run --rm -p 8000:8000 -p 50061:50061 heterogate
# Run start-up's checks on a cluster file with this container's options, without starting anything:
#   docker run --rm -e HETEROGATE_CLUSTER_TOKEN=x -v "$PWD/my.yaml:/tmp/my.yaml:ro" heterogate \
#     gateway check-config /tmp/my.yaml --host 0.0.0.0 --grpc-host 0.0.0.0
# The control port listens on all interfaces, so it needs a cluster token: pass the cluster's with
#   -e HETEROGATE_CLUSTER_TOKEN=...   (external agents send the same one); without it, the container makes a
# random one for this run, which its own engines get and nobody outside knows. Arguments given to
# `docker run` (or a Kubernetes `args:`) replace this CMD, token included: they need the variable set
# (deploy/k8s takes it from a Secret). The HTTP door is open unless gateway.auth sets API keys; start-up
# logs a warning when it listens beyond loopback without them.
FROM python:3.11-slim
COPY pyproject.toml README.md LICENSE /tmp/src/
COPY gateway /tmp/src/gateway
COPY backends /tmp/src/backends
COPY common /tmp/src/common
COPY configs /tmp/src/configs
COPY loadtest /tmp/src/loadtest
# A regular (non-editable) install; the catalogs and the demo cluster are package data.
RUN pip install --no-cache-dir /tmp/src && rm -rf /tmp/src \
 && useradd --system --create-home --uid 10001 heterogate
USER heterogate
WORKDIR /home/heterogate
# HTTP door (OpenAI API, /health, /metrics) and the gRPC server: front door and the control port backends heartbeat to.
EXPOSE 8000 50061
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
CMD ["sh", "-c", "export HETEROGATE_CLUSTER_TOKEN=\"${HETEROGATE_CLUSTER_TOKEN:-$(python -c 'import secrets; print(secrets.token_urlsafe(32))')}\" && exec gateway --host 0.0.0.0 --port 8000 --grpc-host 0.0.0.0 --grpc-port 50061"]
