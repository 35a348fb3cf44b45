"""HeteroGate: a request-level gateway for heterogeneous GPU clusters serving vision-language models."""

__version__ = "0.1.0"
