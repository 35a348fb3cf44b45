"""Load generation for HeteroGate: the discrete-event simulator (`loadtest.sim`) for policy studies at scale."""
