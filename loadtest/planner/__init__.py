"""`gateway plan`: which GPUs, in which roles, for a workload, SLOs and a budget or an inventory.

workload.py (the trace a plan is sized for), space.py (the plans and their capacity bound), evaluate.py
(one plan in the simulator), search.py (branch and bound), cli.py (the command), live_check.py (the
predictions against the live gateway). docs/PLANNING.md describes the method and its results.
"""
