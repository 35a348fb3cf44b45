# The default demo: the gateway and its 8 simulated GPU engines in one container.
#   docker build -t heterogate . && docker run --rm -p 8000:8000 heterogate
# Validate a cluster file without starting anything:
#   docker run --rm -v "$PWD/my.yaml:/tmp/my.yaml:ro" heterogate gateway check-config /tmp/my.yaml
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY gateway gateway
COPY backends backends
COPY heterogate heterogate
COPY configs configs
# A regular (non-editable) install: the image runs the installed package, not the build context. The catalogs
# are looked up next to the installed packages (heterogate/catalog.py: CONFIG_DIR), so configs/ goes there too.
RUN pip install --no-cache-dir . \
 && cp -r configs "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/configs" \
 && useradd --system --create-home --uid 10001 heterogate
USER heterogate
# HTTP door (OpenAI API, /health, /metrics) and the control gRPC port that external backends heartbeat to.
EXPOSE 8000 50061
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
CMD ["gateway", "--backends", "configs/backends.yaml", "--host", "0.0.0.0", "--port", "8000", \
     "--grpc-host", "0.0.0.0", "--grpc-port", "50061"]
