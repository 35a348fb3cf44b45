"""The packaged demo upstream (`gateway demo-upstream`, gateway/demo_upstream.py) with what only tests need.

    python -m tests.fake_openai_server --port 8101 --engine vllm [the demo upstream's options]
                                       [--embeds-only] [--start-delay S] [--children N]

Everything the tests read and steer (/metrics, /control, /stats, failures, tool calls, logprobs, `n`,
`--api-key`, `--max-model-len`, `--no-cache-info`) is the demo upstream's own. Added here:

- `--embeds-only` acts as `vllm serve --enable-mm-embeds --limit-mm-per-prompt '{"image":0}'`: image_url
  parts are refused with 400, and image_embeds parts are decoded as vLLM does (base64 → torch.load with
  weights_only), their shapes listed in `GET /stats` under "checked" (torch is a test dependency, not a
  runtime one);
- `--start-delay S` waits S seconds before serving (a model load), and `--children N` starts N child
  processes (as vLLM starts workers), their pids in `GET /stats` under "children": what the managed-engine
  tests need to see a slow start and a whole process group stopped.
"""

from __future__ import annotations

import argparse
import base64
import io
import subprocess
import sys
import time
from typing import Any

from common.event_loop import run
from gateway.demo_upstream import DemoUpstream, add_arguments, options_from, serve


def _load_tensor(b64: str) -> Any:
    import torch

    return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)


def image_embeds(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Shapes of the request's image_embeds parts; ValueError for an image_url part (images disabled)."""
    seen = []
    for message in body.get("messages") or ():
        for part in message.get("content") if isinstance(message.get("content"), list) else ():
            if part.get("type") == "image_url":
                raise ValueError("At most 0 image(s) may be provided in one prompt.")
            if part.get("type") == "image_embeds":
                embeds = part["image_embeds"]
                grid = None
                if isinstance(embeds, dict):
                    grid = _load_tensor(embeds["image_grid_thw"]).tolist()
                    embeds = embeds["image_embeds"]
                tensor = _load_tensor(embeds)
                seen.append({"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                             "finite": bool(tensor.isfinite().all()), "grid": grid})
    return seen


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.fake_openai_server")
    add_arguments(p)
    p.add_argument("--embeds-only", action="store_true")
    p.add_argument("--start-delay", type=float, default=0.0, help="seconds before serving (a model load)")
    p.add_argument("--children", type=int, default=0, help="child processes to start (as engine workers)")
    args = p.parse_args()
    sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
    workers = [subprocess.Popen(sleeper).pid for _ in range(args.children)]
    time.sleep(args.start_delay)
    upstream = DemoUpstream(options_from(args), check_body=image_embeds if args.embeds_only else None,
                            stats={"children": workers})
    run(serve(upstream, args.host, args.port))


if __name__ == "__main__":
    main()
