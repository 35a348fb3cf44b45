"""The cluster config (backends.yaml) and the gateway section's schemas and secrets; imports no feature module."""
