"""Peak resident memory of a torch engine's model start-up: the vision half, the language half and both.

    python benchmarks/torch_engine_memory.py [--model llava-1.5-tiny] [--dtype auto] [--model-path DIR]

Each row is a fresh process that imports torch and transformers, notes its peak RSS, then builds the model as
an engine of that role does (backends.torch_models.load_model: random weights from the catalog's config, or
`--model-path`'s safetensors) on the CPU, and notes its peak RSS again. Reported: the peak, and the peak less
the after-import peak (what the model's start-up added). Before engines built only their half, every role's
start-up was the `both` row. Writes benchmarks/results/torch_engine_memory_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ROLES = ("vision", "language", "both")

CHILD = """
import json, resource, sys, time
import torch, transformers
from backends.torch_models import load_model
from common.catalog import load_catalog
model, path, dtype, keep = sys.argv[1:5]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
loaded = load_model(load_catalog().model(model), model_path=path or None, seed=0, dtype=dtype, device="cpu",
                    keep=keep)
seconds = time.perf_counter() - start
params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"after_import_mib": base / 1024, "peak_mib": peak / 1024, "param_mib": params / 2**20,
                  "load_s": seconds}))
"""


def measure(model: str, model_path: str | None, dtype: str, keep: str, timeout_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD, model, model_path or "", dtype, keep], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout_s, check=True)
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    row["role"] = keep
    row["startup_mib"] = row["peak_mib"] - row["after_import_mib"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="llava-1.5-tiny")
    p.add_argument("--model-path", default=None, help="a local Hugging Face directory instead of random weights")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args()
    source = "model_path" if args.model_path else "random_weights"
    print(f"{args.model} ({source}, {args.dtype})")
    print("| role | parameters MiB | peak RSS MiB | start-up added MiB | load s |")
    print("|---|---|---|---|---|")
    rows = []
    for keep in ROLES:
        r = measure(args.model, args.model_path, args.dtype, keep, args.timeout_s)
        rows.append(r)
        print(f"| {keep} | {r['param_mib']:,.1f} | {r['peak_mib']:,.0f} | {r['startup_mib']:,.0f} | "
              f"{r['load_s']:.1f} |", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"torch_engine_memory_{args.model}_{source}.json"
    out.write_text(json.dumps({"model": args.model, "source": source, "dtype": args.dtype, "rows": rows}, indent=2))
    print(out.relative_to(ROOT))


if __name__ == "__main__":
    main()
