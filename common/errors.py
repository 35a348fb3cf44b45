"""The root of every error raised on purpose, and the configuration error that both the gateway and
the engines raise (bad backends.yaml or catalog; the message names the file and the field)."""

from __future__ import annotations


class HeteroGateError(Exception):
    """Base of every error the gateway raises on purpose."""


class ConfigError(HeteroGateError):
    """A configuration or catalog file is invalid."""
