"""The gateway's memory under request bodies that stall: RSS before, during and after rounds of them.

    python benchmarks/stalled_bodies.py [--connections 20] [--rounds 2] [--body-timeout 5]
                                        [--checkout DIR] [--out FILE]

One gateway (`kind: openai` in front of benchmarks/mock_openai_engine.py, `limits.body_timeout_s`
from `--body-timeout`) gets, each round, `--connections` raw connections that each declare the
default body cap (32 MiB), send one byte less and stop. RSS of the gateway process (/proc) is read
before the round, once every body is in, and after the round: after the gateway cut them (408) or,
with `--client-closes`, after the clients closed. A request is then sent to show the gateway still
serves. `--checkout DIR` runs another checkout's gateway instead (`git archive <commit> | tar -x -C
DIR`, for before and after; an older one that never cuts a stalled body is closed by the client after
`--body-timeout`). Writes benchmarks/results/stalled_bodies.json and prints the table.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_cluster import launch  # noqa: E402
from benchmarks.front_door import body, openai_config, process, wait_http  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from testkit.harness import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "stalled_bodies.json"
DECLARED = 32 << 20   # the default limits.max_body_bytes
IO_S = 30.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stall(port: int) -> socket.socket:
    """A connection that declares DECLARED bytes of body and sends one fewer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=IO_S)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % DECLARED)
    sock.sendall(b" " * (DECLARED - 1))
    return sock


def answer(sock: socket.socket, wait_s: float) -> bytes:
    """The status line the gateway sent on `sock` within `wait_s`, b"" for none."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(4096).split(b"\r\n", 1)[0]
    except (TimeoutError, ConnectionError):
        return b""


def round_of(pid: int, port: int, connections: int, body_timeout_s: float, client_closes: bool) -> dict[str, Any]:
    before = rss_mb(pid)
    t0 = time.monotonic()
    socks = [stall(port) for _ in range(connections)]
    time.sleep(0.5)   # the last bytes sent are read
    during = rss_mb(pid)
    if client_closes:
        statuses = [b"" for _ in socks]
    else:
        deadline = t0 + body_timeout_s + 5
        statuses = [answer(s, max(0.1, deadline - time.monotonic())) for s in socks]
    for s in socks:
        s.close()
    time.sleep(2.0)   # the gateway hands memory back a second after it drops a large body
    after = rss_mb(pid)
    return {"rss_before_mb": before, "rss_during_mb": during, "rss_after_mb": after,
            "answers": sorted({s.decode("latin-1") or "(none)" for s in statuses})}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| round | RSS before MB | RSS with the bodies in MB | RSS after MB | answers |")
    print("|---:|---:|---:|---:|---|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['rss_before_mb']:,.0f} | {r['rss_during_mb']:,.0f} | {r['rss_after_mb']:,.0f} | "
              f"{', '.join(r['answers'])} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--connections", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--body-timeout", type=float, default=5.0, help="limits.body_timeout_s of the gateway")
    p.add_argument("--client-closes", action="store_true", help="the clients close instead of waiting for a 408")
    p.add_argument("--checkout", type=Path, help="run this checkout's gateway (before/after)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        engine = free_port()
        url = f"http://127.0.0.1:{engine}"
        with process([sys.executable, str(ROOT / "benchmarks" / "mock_openai_engine.py"), "--port", str(engine)],
                     tmp / "mock.log") as mock:
            wait_http(f"{url}/v1/chat/completions", mock)
            limits = {} if args.checkout else {"limits": {"body_timeout_s": args.body_timeout}}
            config = openai_config(tmp, [url], **limits)
            checkout = (args.checkout or ROOT).resolve()
            with launch(config, [sys.executable, "-m", "gateway.cli"], checkout) as gw:
                port = int(gw.url.rsplit(":", 1)[1])
                rows = []
                for i in range(args.rounds):
                    print(f"round {i + 1}/{args.rounds}", flush=True)
                    rows.append(round_of(gw.process.pid, port, args.connections, args.body_timeout,
                                         args.client_closes))
                    served = httpx.post(f"{gw.url}/v1/chat/completions", content=body(4, False), timeout=IO_S,
                                        headers={"content-type": "application/json"}).status_code
                    rows[-1]["served_after"] = served
    print_table(rows)
    save_report(args.out, {"wall_s": time.monotonic() - started, "git": git_state(checkout),
                           "connections": args.connections, "declared_bytes": DECLARED,
                           "body_timeout_s": args.body_timeout, "client_closes": args.client_closes, "rounds": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
