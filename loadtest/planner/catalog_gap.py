"""What the gateway lacks to run a plan made with a catalog of its own (`gateway plan --catalog`).

The gateway resolves a backends.yaml's model and GPU names against its built-in catalog only
(`gateway.config.cluster.load_cluster`), and a backends.yaml has no key that names another. So a plan
priced and simulated with `--catalog` runs as written only where the built-in catalog has its GPUs and
model; where that catalog has them with other figures, the gateway and its simulated engines run on its
figures, not on those the plan was simulated with. The planner says so rather than write a file that
`gateway --backends` refuses without a word of why.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.catalog import Catalog, ModelProfile


def catalog_gap(gpus: Iterable[str], model: ModelProfile, catalog: Catalog, builtin: Catalog) -> list[str]:
    """Sentences on what `builtin` lacks, or describes otherwise, of a plan's GPUs and model (none: nothing)."""
    gpus = sorted(set(gpus))
    missing = [f"GPU {g}" for g in gpus if g not in builtin.gpus]
    if model.name not in builtin.models:
        missing.append(f"model {model.name}")
    differ = [f"GPU {g}" for g in gpus if g in builtin.gpus and builtin.gpus[g] != catalog.gpus[g]]
    if model.name in builtin.models and builtin.models[model.name] != model:
        differ.append(f"model {model.name}")
    notes = []
    if missing:
        notes.append(f"The gateway's built-in catalog lacks {', '.join(missing)}, and a backends.yaml cannot name "
                     "another catalog: this file runs only on a gateway whose own catalog (its configs/gpus.yaml and "
                     "configs/models.yaml) has them.")
    if differ:
        notes.append(f"The gateway's built-in catalog describes {', '.join(differ)} otherwise than the catalog "
                     "this plan was made with: the gateway runs this file on its own figures.")
    return notes
