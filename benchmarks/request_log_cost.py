"""CPU cost of the per-request log line and counters (gateway.pipeline.request_log), in process.

    python benchmarks/request_log_cost.py [--requests 20000] [--repeats 5]

Cells, each the minimum over `repeats` of CPU time (time.process_time) per request, the line going
to /dev/null at level info (as a gateway run with --log-level info writes it):

- `record+finish`: what the request path pays: a RequestRecord, one attempt, RequestLog.finish
  (request counter, token counters, the JSON line);
- `line only`: the same line through our structlog set-up (orjson, bytes straight to the stream);
- `line only, stdlib json`: the same line through a structlog chain rendering with the stdlib json
  module to a text stream, as configured before the orjson renderer.

Writes benchmarks/results/request_log_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.catalog import load_catalog  # noqa: E402
from common.logs import configure_logging  # noqa: E402
from gateway.pipeline.metrics import GatewayMetrics  # noqa: E402
from gateway.pipeline.request_log import RequestLog, RequestRecord  # noqa: E402
from gateway.routing.state_table import StateTable  # noqa: E402

FIELDS = dict(request_id="0123456789abcdef0123456789abcdef", endpoint="chat", status=200, attempts=1,
              backends=["h100-0"], vision_backends=[], policy="heteroserve", latency_s=0.1234, ttft_s=0.0123,
              prompt_tokens=31, completion_tokens=64, error=None)


def per_call_us(fn: Callable[[int], None], n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn(n)
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def stdlib_json_chain() -> None:
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(20),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr), cache_logger_on_first_use=False,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    out = sys.stdout
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)   # the lines go nowhere; the cost of rendering and writing them stays
    catalog = load_catalog()
    metrics = GatewayMetrics(StateTable(catalog.model("llava-1.5-7b"), 0.2))
    requests = RequestLog(metrics, "heteroserve")

    def record_and_finish(n: int) -> None:
        for i in range(n):
            record = RequestRecord(str(i), "chat")
            record.attempt("h100-0")
            requests.finish(record, 200, prompt_tokens=31, completion_tokens=64)

    def line(n: int) -> None:
        log = structlog.get_logger("bench")
        for _ in range(n):
            log.info("request", **FIELDS)

    cells: dict[str, float] = {}
    configure_logging("info")
    cells["record+finish"] = per_call_us(record_and_finish, args.requests, args.repeats)
    cells["line only"] = per_call_us(line, args.requests, args.repeats)
    stdlib_json_chain()
    cells["line only, stdlib json"] = per_call_us(line, args.requests, args.repeats)
    print(f"{'cell':<26}{'us/request':>12}", file=out)
    for name, us in cells.items():
        print(f"{name:<26}{us:>12.1f}", file=out)
    result = {"requests": args.requests, "repeats": args.repeats, "us_per_request": cells}
    (ROOT / "benchmarks" / "results" / "request_log_cost.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
