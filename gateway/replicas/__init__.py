"""Several gateways as one: shared state in Redis, the leader lease over managed engines, and worker processes on
one port.
"""
