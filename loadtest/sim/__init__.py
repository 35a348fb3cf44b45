"""Discrete-event simulator of a heterogeneous GPU cluster in virtual time.

It calls the gateway's own router (`gateway.routing.policies.build_policy`) and advances time with the shared
performance model (`common.perf_model`) and continuous batcher (`backends.batcher`), so a policy
measured here is the object the live gateway runs. `python -m loadtest.sim.report` regenerates
docs/BENCHMARKS.md and docs/results/.
"""
