"""The embedding hand-off between real engine processes, driven over gRPC without a gateway.

A standalone language engine (H100) and vision engine (RTX 4090) heartbeat to a Control service run
by the test; a third, test-side Engine server records every `DeliverEmbedding` it receives, so the
bytes that travel vision → language are checked where they arrive:

    Encode(deliver_to=recorder)               → real tensors of tokens × hidden × dtype bytes each
    Encode(deliver_to=language) + Generate    → the language engine waits for the embeddings, then
                                                 prefills text + image tokens
    Generate with embeddings that never come  → ABORTED after embedding_timeout_ms, naming the count
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from common import perf_model, service_time
from common.catalog import load_catalog
from common.wire import engine_pb2, engine_pb2_grpc
from testkit.harness import StandaloneEngines, image_bytes, standalone_engines

MODEL = "llava-1.5-7b"
LLAVA_TOKENS, LLAVA_HIDDEN, FP16_BYTES = 576, 4096, 2
EMBEDDING_BYTES = LLAVA_TOKENS * LLAVA_HIDDEN * FP16_BYTES   # 4,718,592 bytes per image
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]

pytestmark = pytest.mark.timeout(60)


@dataclass
class Recorder(engine_pb2_grpc.EngineServicer):
    """A stand-in language engine that only records the embeddings delivered to it."""

    received: list[engine_pb2.Embedding] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def DeliverEmbedding(self, request: engine_pb2.Embedding, context: grpc.ServicerContext) -> engine_pb2.DeliverReply:
        with self.lock:
            self.received.append(request)
        return engine_pb2.DeliverReply(accepted=True)

    def for_request(self, request_id: str) -> list[engine_pb2.Embedding]:
        with self.lock:
            return sorted((e for e in self.received if e.request_id == request_id), key=lambda e: e.image_index)


@dataclass
class Cluster:
    engines: StandaloneEngines
    language: engine_pb2_grpc.EngineStub
    vision: engine_pb2_grpc.EngineStub
    language_address: str
    recorder: Recorder
    recorder_address: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp: Path = tmp_path_factory.mktemp("handoff")
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    engine_pb2_grpc.add_EngineServicer_to_server(recorder, server)
    recorder_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with standalone_engines(MODEL, tmp) as engines:
        engines.launch("lang-0", "language", "H100", "--time-scale", "0.05")
        engines.launch("vis-0", "vision", "RTX-4090", "--time-scale", "0.05", "--vision-batch", "4")
        language_address, vision_address = engines.address("lang-0"), engines.address("vis-0")
        with grpc.insecure_channel(language_address, options=CHANNEL_OPTIONS) as lch, \
                grpc.insecure_channel(vision_address, options=CHANNEL_OPTIONS) as vch:
            yield Cluster(engines, engine_pb2_grpc.EngineStub(lch), engine_pb2_grpc.EngineStub(vch),
                          language_address, recorder, f"127.0.0.1:{recorder_port}")
    server.stop(grace=None)


def encode_request(request_id: str, deliver_to: str, n: int) -> engine_pb2.EncodeRequest:
    formats = ("PNG", "JPEG", "WEBP")
    images = [
        engine_pb2.Image(data=image_bytes(formats[i % 3], (40 + i, 30)), width=40 + i, height=30, tokens=LLAVA_TOKENS)
        for i in range(n)
    ]
    return engine_pb2.EncodeRequest(request_id=request_id, deliver_to=deliver_to, images=images)


def generate_request(request_id: str, n: int, *, timeout_ms: int = 10_000, prompt_tokens: int = 9,
                     max_tokens: int = 3) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt="user: describe", prompt_tokens=prompt_tokens,
        image_tokens=n * LLAVA_TOKENS, max_tokens=max_tokens, temperature=1.0, embedding_count=n,
        embedding_timeout_ms=timeout_ms,
    )


def test_encode_delivers_real_embedding_bytes_of_the_expected_size(cluster: Cluster) -> None:
    before = cluster.engines.reported("vis-0")
    reply = cluster.vision.Encode(encode_request("rec-1", cluster.recorder_address, 3), timeout=20)
    assert reply.image_tokens == 3 * LLAVA_TOKENS
    assert reply.embedding_bytes == 3 * EMBEDDING_BYTES
    got = cluster.recorder.for_request("rec-1")
    assert [e.image_index for e in got] == [0, 1, 2]
    for e in got:
        assert (e.tokens, e.hidden, e.dtype) == (LLAVA_TOKENS, LLAVA_HIDDEN, "float16")
        assert len(e.data) == EMBEDDING_BYTES
    assert len({e.data[:4096] for e in got}) == 3, "each image's embedding should be its own tensor"
    after = cluster.engines.wait_reported(
        "vis-0", lambda r: r.embedding_bytes_sent >= before.embedding_bytes_sent + 3 * EMBEDDING_BYTES)
    assert after.embedding_bytes_sent == before.embedding_bytes_sent + 3 * EMBEDDING_BYTES
    assert after.images_encoded == before.images_encoded + 3


def test_language_engine_waits_for_the_embeddings_then_prefills_text_plus_image_tokens(cluster: Cluster) -> None:
    n = 2
    stream = cluster.language.Generate(generate_request("hand-1", n), timeout=30)   # starts waiting now
    time.sleep(0.5)   # the engine has it (and waits) before the embeddings are sent, however loaded the machine
    reply = cluster.vision.Encode(encode_request("hand-1", cluster.language_address, n), timeout=20)
    assert reply.embedding_bytes == n * EMBEDDING_BYTES
    chunks = list(stream)
    assert chunks[0].embedding_wait_s >= 0.05, "Generate must not start before its embeddings arrived"
    last = chunks[-1]
    assert last.finish_reason in {"stop", "length"}
    assert last.usage.prompt_tokens == 9 + n * LLAVA_TOKENS
    assert last.usage.completion_tokens == len(chunks)


def test_embeddings_delivered_before_generate_are_kept_for_it(cluster: Cluster) -> None:
    cluster.vision.Encode(encode_request("early-1", cluster.language_address, 1), timeout=20)
    chunks = list(cluster.language.Generate(generate_request("early-1", 1, timeout_ms=2000), timeout=30))
    assert chunks[-1].finish_reason and chunks[-1].usage.prompt_tokens == 9 + LLAVA_TOKENS


def test_generate_aborts_when_the_embeddings_never_arrive(cluster: Cluster) -> None:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.language.Generate(generate_request("never-1", 1, timeout_ms=300), timeout=30))
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.code() == grpc.StatusCode.ABORTED, err
    assert "never-1" in err.details() and "0 of 1 image embeddings" in err.details(), err.details()
    assert elapsed >= 0.3, "aborted before its embedding timeout"
    # The engine is fine afterwards: the same request id can still be served once its embedding comes.
    cluster.vision.Encode(encode_request("never-1", cluster.language_address, 1), timeout=20)
    chunks = list(cluster.language.Generate(generate_request("never-1", 1, timeout_ms=2000), timeout=30))
    assert chunks[-1].finish_reason


def test_generate_aborts_when_only_some_embeddings_arrive(cluster: Cluster) -> None:
    stream = cluster.language.Generate(generate_request("partial-1", 2, timeout_ms=500), timeout=30)
    cluster.language.DeliverEmbedding(engine_pb2.Embedding(
        request_id="partial-1", image_index=0, tokens=LLAVA_TOKENS, hidden=LLAVA_HIDDEN, dtype="float16",
        data=bytes(EMBEDDING_BYTES)), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "1 of 2 image embeddings" in info.value.details(), info.value.details()


def test_encode_to_an_unreachable_language_engine_fails_clearly(cluster: Cluster) -> None:
    import socket

    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(grpc.RpcError) as info:
        cluster.vision.Encode(encode_request("dead-1", dead, 1), timeout=20)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dead in info.value.details()
    # ... and the vision engine keeps serving.
    reply = cluster.vision.Encode(encode_request("alive-1", cluster.recorder_address, 1), timeout=20)
    assert reply.embedding_bytes == EMBEDDING_BYTES


def test_engine_roles_are_enforced(cluster: Cluster) -> None:
    with pytest.raises(grpc.RpcError) as info:
        cluster.language.Encode(encode_request("role-1", cluster.recorder_address, 1), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.vision.Generate(generate_request("role-2", 0), timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_encode_without_deliver_to_returns_the_embeddings_in_the_reply(cluster: Cluster) -> None:
    """The path for language backends that take embeddings in their own request (vLLM image_embeds)."""
    delivered = len(cluster.recorder.received)
    reply = cluster.vision.Encode(encode_request("inline-1", "", 2), timeout=20)
    assert reply.embedding_bytes == 2 * EMBEDDING_BYTES
    assert [(e.request_id, e.image_index, e.tokens, e.hidden, e.dtype, len(e.data)) for e in reply.embeddings] == [
        ("inline-1", i, LLAVA_TOKENS, LLAVA_HIDDEN, "float16", EMBEDDING_BYTES) for i in range(2)]
    values = np.frombuffer(reply.embeddings[0].data, dtype=np.float16).astype(np.float32)
    assert np.isfinite(values).all() and values.std() > 0   # real numbers, not NaN bit patterns or zeros
    assert len(cluster.recorder.received) == delivered


def test_whole_generate_sends_the_first_token_then_the_rest_in_one_message(cluster: Cluster) -> None:
    def request(request_id: str, whole: bool) -> engine_pb2.GenerateRequest:
        return engine_pb2.GenerateRequest(request_id=request_id, prompt="user: hi", prompt_tokens=5,
                                          max_tokens=12, whole=whole)

    streamed = list(cluster.language.Generate(request("same-id", False), timeout=30))
    whole = list(cluster.language.Generate(request("same-id", True), timeout=30))
    assert len(whole) == 2 and whole[0].index == 0 and not whole[0].finish_reason
    assert "".join(c.text for c in whole) == "".join(c.text for c in streamed)
    assert (whole[-1].finish_reason, whole[-1].index) == (streamed[-1].finish_reason, streamed[-1].index)
    assert whole[-1].usage == streamed[-1].usage


def test_a_time_scaled_engine_reports_service_time_in_its_own_seconds(cluster: Cluster) -> None:
    """The gateway measures an engine's first tokens and decode steps on its own clock, and prices the wait
    for KV with T̄_service beside them: an engine that runs 4× slower than the model says reports 4× the
    model's seconds (the performance model's service time exactly, times 4)."""
    cluster.engines.launch("slow-0", "language", "A100-80GB", "--time-scale", "4")
    with grpc.insecure_channel(cluster.engines.address("slow-0")) as channel:
        request = engine_pb2.GenerateRequest(request_id="timed-1", prompt="user: hi", prompt_tokens=9, max_tokens=8)
        chunks = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=30))
    assert len(chunks) == 8   # natural lengths are ≥ 16 tokens: max_tokens decides
    catalog = load_catalog()
    model, gpu = catalog.model(MODEL), catalog.gpu("A100-80GB")
    expected = 4 * (perf_model.prefill_seconds(model, gpu, 9) + sum(
        perf_model.decode_step_seconds(model, gpu, 1, 9 + k) for k in range(1, 8)))
    prior = 4 * service_time.prior_service_s(model, gpu)   # reported from the start; one sample moves it by a fifth
    reported = cluster.engines.wait_reported("slow-0", lambda r: r.mean_service_s != prior).mean_service_s
    assert reported == pytest.approx(service_time.updated_mean_service(prior, expected), rel=1e-6)
