"""What the gateway's built-in catalog lacks, or describes otherwise, of a plan made with another catalog."""

from __future__ import annotations

from common.catalog import Catalog, load_catalog
from loadtest.planner.catalog_gap import catalog_gap

BUILTIN = load_catalog()
MODEL = BUILTIN.model("llava-1.5-7b")


def test_a_plan_of_the_builtin_catalog_needs_nothing() -> None:
    assert catalog_gap(["H100", "L4"], MODEL, BUILTIN, load_catalog()) == []


def test_missing_gpus_and_model_are_named() -> None:
    model = MODEL.model_copy(update={"name": "mystery-7b"})
    own = Catalog({"MI300X": BUILTIN.gpu("H100").model_copy(update={"name": "MI300X"}), "H100": BUILTIN.gpu("H100")},
                  {"mystery-7b": model})
    [note] = catalog_gap(["MI300X", "H100", "MI300X"], model, own, BUILTIN)
    assert "lacks GPU MI300X, model mystery-7b," in note and "H100" not in note


def test_gpus_described_otherwise_are_named() -> None:
    cheap = BUILTIN.gpu("L4").model_copy(update={"price_per_hour": 0.01})
    own = Catalog({"L4": cheap, "H100": BUILTIN.gpu("H100")}, BUILTIN.models)
    [note] = catalog_gap(["L4", "H100"], MODEL, own, BUILTIN)
    assert "describes GPU L4 otherwise" in note and "H100" not in note
