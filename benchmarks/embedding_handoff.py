"""Embedding vs KV-cache bytes per vision-language request, and the measured hand-off time on loopback.

    python benchmarks/embedding_handoff.py [--quick] [--requests 100] [--text-tokens 124]

Sizes (common.perf_model, configs/models.yaml), per model with a vision encoder and image size:
    embedding bytes = image tokens · hidden · dtype bytes                (what the vision GPU sends)
    KV bytes        = (image tokens + text tokens) · 2 · layers · kv_heads · head_dim · dtype bytes
                      (what the language GPU would receive if the split were after prefill instead)
The text prompt is --text-tokens (default 124): the paper's LLaVA-1.5-7B row (≈ 4.5 MB embedding vs
≈ 350 MB of KV, ratio ≈ 78) is reproduced exactly by 576 image + 124 text = 700 tokens with MB read
as MiB; the KV of the image tokens alone is given too. No generated tokens are counted.

Hand-off, measured: for each model, a real language engine (H100) and a real vision engine
(RTX-4090) run as `python -m backends.engine ... --time-scale 0 --vision-batch 1` (no simulated
GPU time, no batch wait), heartbeating a grpc.aio Control server inside this script
(gateway.control.heartbeat_service.ControlService over a StateTable with both registered). Per request,
sequentially (one in flight), as the gateway's pipeline does: Generate(embedding_count=1,
max_tokens=1) on the language engine and Encode(deliver_to=language engine) on the vision engine at
once. Reported p50/p99 over --requests: the Encode RPC end to end (client side), the vision
engine's EncodeReply.deliver_s (making the embedding payload + the DeliverEmbedding RPC), the
language engine's embedding_wait_s, and a DeliverEmbedding of the same size sent straight from this
script (payload prepared in advance, so pure transfer). The bare transport too: the same message to a
do-nothing grpc.aio server with default HTTP/2 settings vs BDP probing off (`grpc.http2.bdp_probe`
0 on both ends), alternating. Also the time to make the payload (numpy
rng.bytes, as the vision engine does) so deliver_s can be read net of it. The image sent is a
JPEG of the stated size (the simulated encoder does not decode it). Writes
benchmarks/results/embedding_handoff.json.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_cluster import stop_process  # noqa: E402
from benchmarks.loadgen import percentile  # noqa: E402
from common import perf_model  # noqa: E402
from common.catalog import Catalog, ModelProfile, load_catalog  # noqa: E402
from common.event_loop import run  # noqa: E402
from common.logs import configure_logging  # noqa: E402
from common.wire import control_pb2_grpc, engine_pb2, engine_pb2_grpc  # noqa: E402
from gateway.control.heartbeat_service import ControlService  # noqa: E402
from gateway.routing.signals import LocalSignals  # noqa: E402
from gateway.routing.state_table import StateTable  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "embedding_handoff.json"
CASES: tuple[tuple[str, int, int], ...] = (
    ("llava-1.5-7b", 336, 336), ("qwen2.5-vl-7b", 1024, 768), ("qwen2.5-vl-7b", 448, 448),
)
LANGUAGE_GPU, VISION_GPU = "H100", "RTX-4090"
MIB = 1 << 20
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


@dataclass(frozen=True)
class Sizes:
    model: str
    width: int
    height: int
    image_tokens: int
    text_tokens: int
    embedding_bytes: int
    kv_bytes: int
    kv_bytes_image_only: int

    @property
    def ratio(self) -> float:
        return self.kv_bytes / self.embedding_bytes


def sizes(model: ModelProfile, width: int, height: int, text_tokens: int) -> Sizes:
    tokens = model.image_tokens(width, height)
    return Sizes(model.name, width, height, tokens, text_tokens, perf_model.embedding_bytes(model, tokens),
                 perf_model.kv_bytes(model, tokens + text_tokens), perf_model.kv_bytes(model, tokens))


def paper_check(catalog: Catalog) -> dict[str, Any]:
    """How ≈ 4.5 MB vs ≈ 350 MB (ratio ≈ 78) arises for LLaVA-1.5-7B, and the token count it implies."""
    m = catalog.model("llava-1.5-7b")
    emb = perf_model.embedding_bytes(m, m.image_tokens(336, 336))
    return {
        "embedding_bytes": emb, "embedding_mib": emb / MIB, "kv_bytes_per_token": m.kv_bytes_per_token,
        "tokens_for_350_mib": 350 * MIB / m.kv_bytes_per_token,
        "tokens_for_ratio_78": 78 * emb / m.kv_bytes_per_token,
        "note": "576 image tokens x 4096 hidden x 2 B = 4.5 MiB; KV = 2 x 32 layers x 32 heads x 128 x 2 B = "
                "0.5 MiB/token, so ratio = tokens / 9 and 350 MiB = 700 tokens = 576 image + 124 text",
    }


def jpeg(width: int, height: int) -> bytes:
    x = np.linspace(0, 255, width, dtype=np.uint8)
    y = np.linspace(0, 255, height, dtype=np.uint8)
    rgb = np.stack([np.add.outer(y // 2, x // 2), np.tile(x, (height, 1)), np.tile(y[:, None], (1, width))], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def start_engine(backend_id: str, role: str, gpu: str, model: str, control: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "backends.engine", "--backend-id", backend_id, "--role", role, "--gpu", gpu,
           "--model", model, "--gateway", control, "--time-scale", "0", "--vision-batch", "1",
           "--heartbeat-ms", "200", "--log-level", "warning"]
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)


async def wait_registered(table: StateTable, ids: tuple[str, ...], timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = [table.get(i) for i in ids]
        if all(e is not None and e.last_heartbeat is not None and e.address for e in entries):
            return {e.id: str(e.address) for e in entries if e is not None}
        await asyncio.sleep(0.05)
    raise TimeoutError(f"engines {ids} did not heartbeat within {timeout_s} s")


def stats_ms(values_s: list[float]) -> dict[str, float]:
    v = sorted(x * 1000 for x in values_s)
    return {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "mean_ms": sum(v) / len(v)}


async def one_handoff(
    language: engine_pb2_grpc.EngineStub, vision: engine_pb2_grpc.EngineStub, language_address: str,
    request_id: str, image: engine_pb2.Image,
) -> dict[str, float]:
    gen = language.Generate(engine_pb2.GenerateRequest(
        request_id=request_id, prompt="user: describe the image", prompt_tokens=8, image_tokens=image.tokens,
        max_tokens=1, temperature=1.0, embedding_count=1, embedding_timeout_ms=10_000), timeout=30)
    t0 = time.perf_counter()
    reply = await vision.Encode(engine_pb2.EncodeRequest(request_id=request_id, images=[image],
                                                         deliver_to=language_address), timeout=30)
    encode_s = time.perf_counter() - t0
    wait_s = 0.0
    async for chunk in gen:
        if chunk.index == 0:
            wait_s = chunk.embedding_wait_s
    return {"encode_rpc_s": encode_s, "deliver_s": reply.deliver_s, "engine_encode_s": reply.encode_s,
            "embedding_wait_s": wait_s, "embedding_bytes": float(reply.embedding_bytes)}


async def measure_case(
    model: ModelProfile, s: Sizes, addresses: dict[str, str], requests: int
) -> dict[str, Any]:
    image = engine_pb2.Image(data=jpeg(s.width, s.height), width=s.width, height=s.height, tokens=s.image_tokens)
    payload = np.random.default_rng(1).bytes(s.embedding_bytes)
    direct = engine_pb2.Embedding(request_id="direct-deliver", image_index=0, tokens=s.image_tokens,
                                  hidden=model.hidden, dtype=model.dtype, data=payload)
    async with grpc.aio.insecure_channel(addresses["language"], options=_CHANNEL_OPTIONS) as lch, \
            grpc.aio.insecure_channel(addresses["vision"], options=_CHANNEL_OPTIONS) as vch:
        language, vision = engine_pb2_grpc.EngineStub(lch), engine_pb2_grpc.EngineStub(vch)
        for i in range(3):   # warm-up: channels, the vision engine's channel to the language engine
            await one_handoff(language, vision, addresses["language"], f"warm-{s.width}-{i}", image)
        rows = [await one_handoff(language, vision, addresses["language"], f"r-{s.width}x{s.height}-{i}", image)
                for i in range(requests)]
        deliveries = []
        for _ in range(requests):   # same request id and index: the store keeps one copy, nothing piles up
            t0 = time.perf_counter()
            await language.DeliverEmbedding(direct, timeout=30)
            deliveries.append(time.perf_counter() - t0)
    rng = np.random.default_rng(2)
    make = []
    for _ in range(min(requests, 20)):
        t0 = time.perf_counter()
        rng.bytes(s.embedding_bytes)
        make.append(time.perf_counter() - t0)
    assert all(r["embedding_bytes"] == s.embedding_bytes for r in rows), "delivered size differs from the model"
    return {
        "image_bytes": len(image.data), "requests": requests,
        "encode_rpc": stats_ms([r["encode_rpc_s"] for r in rows]),
        "deliver_s": stats_ms([r["deliver_s"] for r in rows]),
        "embedding_wait": stats_ms([r["embedding_wait_s"] for r in rows]),
        "direct_deliver": stats_ms(deliveries),
        "make_payload": stats_ms(make),
        "direct_deliver_gb_s": s.embedding_bytes / (stats_ms(deliveries)["p50_ms"] / 1000) / 1e9,
    }


class _Receiver(engine_pb2_grpc.EngineServicer):
    async def DeliverEmbedding(
        self, request: engine_pb2.Embedding, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DeliverReply:
        return engine_pb2.DeliverReply(accepted=True)


async def bare_transfer(nbytes: int, requests: int) -> dict[str, dict[str, float]]:
    """DeliverEmbedding of `nbytes` to a do-nothing grpc.aio server, HTTP/2 BDP probing on vs off (both ends).

    The transport alone, without the language engine; the two settings alternate in blocks of 5.
    """
    settings: dict[str, list[tuple[str, int]]] = {"default": [], "bdp_probe=0": [("grpc.http2.bdp_probe", 0)]}
    emb = engine_pb2.Embedding(request_id="bare", data=np.random.default_rng(3).bytes(nbytes))
    servers, stubs, channels = [], {}, []
    for name, opts in settings.items():
        server = grpc.aio.server(options=_CHANNEL_OPTIONS + opts)
        engine_pb2_grpc.add_EngineServicer_to_server(_Receiver(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS + opts)
        channels.append(channel)
        stubs[name] = engine_pb2_grpc.EngineStub(channel)
    times: dict[str, list[float]] = {name: [] for name in settings}
    try:
        for stub in stubs.values():   # warm-up
            await stub.DeliverEmbedding(emb, timeout=30)
        for _ in range(max(1, requests // 5)):
            for name, stub in stubs.items():
                for _ in range(5):
                    t0 = time.perf_counter()
                    await stub.DeliverEmbedding(emb, timeout=30)
                    times[name].append(time.perf_counter() - t0)
    finally:
        for c in channels:
            await c.close()
        for srv in servers:
            await srv.stop(grace=0)
    return {name: stats_ms(v) for name, v in times.items()}


async def measure_model(catalog: Catalog, name: str, cases: list[Sizes], requests: int) -> list[dict[str, Any]]:
    model = catalog.model(name)
    table = StateTable(model, heartbeat_interval_s=0.2)
    table.register("language", "language", catalog.gpu(LANGUAGE_GPU), address=None, managed=False)
    table.register("vision", "vision", catalog.gpu(VISION_GPU), address=None, managed=False)
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(ControlService(LocalSignals(table)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    control = f"127.0.0.1:{port}"
    procs = [start_engine("language", "language", LANGUAGE_GPU, name, control),
             start_engine("vision", "vision", VISION_GPU, name, control)]
    try:
        addresses = await wait_registered(table, ("language", "vision"), timeout_s=30)
        return [{**asdict(s), "kv_over_embedding": s.ratio, **await measure_case(model, s, addresses, requests),
                 "bare_transfer": await bare_transfer(s.embedding_bytes, requests)} for s in cases]
    finally:
        for p in procs:
            stop_process(p)
        await server.stop(grace=0.5)


def print_tables(rows: list[dict[str, Any]], text_tokens: int) -> None:
    print(f"\n{'model':14s} {'image':>9s} {'img tok':>7s} {'embedding':>10s} {'KV img+text':>12s} {'ratio':>6s} "
          f"{'KV img only':>12s} {'ratio':>6s}   (text prompt: {text_tokens} tokens; MiB)")
    for r in rows:
        print(f"{r['model']:14s} {r['width']:>4d}x{r['height']:<4d} {r['image_tokens']:7d} "
              f"{r['embedding_bytes'] / MIB:10.2f} {r['kv_bytes'] / MIB:12.1f} {r['kv_over_embedding']:6.1f} "
              f"{r['kv_bytes_image_only'] / MIB:12.1f} {r['kv_bytes_image_only'] / r['embedding_bytes']:6.1f}")
    print(f"\n{'model':14s} {'image':>9s} {'Encode RPC p50/p99 ms':>22s} {'deliver_s p50/p99 ms':>21s} "
          f"{'direct Deliver p50/p99 ms':>26s} {'GB/s':>5s} {'make payload ms':>15s} {'lang wait p50 ms':>16s}")
    for r in rows:
        e, d, dd = r["encode_rpc"], r["deliver_s"], r["direct_deliver"]
        print(f"{r['model']:14s} {r['width']:>4d}x{r['height']:<4d} {e['p50_ms']:10.2f} / {e['p99_ms']:7.2f}   "
              f"{d['p50_ms']:9.2f} / {d['p99_ms']:7.2f}   {dd['p50_ms']:12.2f} / {dd['p99_ms']:9.2f}   "
              f"{r['direct_deliver_gb_s']:5.2f} {r['make_payload']['p50_ms']:15.2f} "
              f"{r['embedding_wait']['p50_ms']:16.2f}")
    print(f"\n{'model':14s} {'image':>9s} {'MiB':>6s}  bare DeliverEmbedding p50/p99 ms: default | bdp_probe=0")
    for r in rows:
        b, o = r["bare_transfer"]["default"], r["bare_transfer"]["bdp_probe=0"]
        print(f"{r['model']:14s} {r['width']:>4d}x{r['height']:<4d} {r['embedding_bytes'] / MIB:6.2f}  "
              f"{b['p50_ms']:8.2f} / {b['p99_ms']:7.2f} | {o['p50_ms']:8.2f} / {o['p99_ms']:7.2f}")


async def _main(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    requests = args.requests or (15 if args.quick else 100)
    by_model: dict[str, list[Sizes]] = {}
    for name, w, h in CASES:
        by_model.setdefault(name, []).append(sizes(catalog.model(name), w, h, args.text_tokens))
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for name, cases in by_model.items():
        print(f"measuring {name}: {len(cases)} image size(s), {requests} requests each", flush=True)
        rows += await measure_model(catalog, name, cases, requests)
    check = paper_check(catalog)
    print_tables(rows, args.text_tokens)
    print(f"\npaper check (LLaVA-1.5-7B): embedding {check['embedding_mib']:.2f} MiB; KV "
          f"{check['kv_bytes_per_token'] / MIB:.2f} MiB/token; 350 MiB = {check['tokens_for_350_mib']:.0f} tokens; "
          f"ratio 78 = {check['tokens_for_ratio_78']:.0f} tokens (576 image + ~124 text)")
    report = {
        "benchmark": "embedding_handoff", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
        "settings": {"text_tokens": args.text_tokens, "requests": requests, "language_gpu": LANGUAGE_GPU,
                     "vision_gpu": VISION_GPU, "time_scale": 0, "quick": args.quick},
        "paper_check": check, "cases": rows, "wall_s": time.monotonic() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run (< 30 s): 15 requests per case")
    p.add_argument("--requests", type=int, help="hand-offs per case (default 100; 15 with --quick)")
    p.add_argument("--text-tokens", type=int, default=124, help="text prompt tokens counted in the KV bytes")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    configure_logging("warning")
    run(_main(args))


if __name__ == "__main__":
    main()
