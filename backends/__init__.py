"""Engines the gateway manages: the engine server, its executors, and the performance model."""
