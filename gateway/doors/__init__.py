"""The doors: where requests come in. The HTTP server and its routes, the gRPC front door, TLS, request ids; a door
parses, authenticates and hands a job to the runtime's pipeline.
"""
