"""What the gateway daemon and the engines both need: catalogs, wire code, the performance model,
logging, engine metric tables and the heartbeat sender. `gateway` and `backends` import this package,
never each other."""

__version__ = "0.1.0"
