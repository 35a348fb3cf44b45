"""HeteroGate: a request-level gateway for heterogeneous GPU clusters serving vision-language models."""

__version__ = "0.1.0"

import os as _os

# The gateway forks engine processes while gRPC threads run; gRPC's fork handlers are not needed
# (children exec at once) and only print warnings. Must be set before grpc is imported.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
