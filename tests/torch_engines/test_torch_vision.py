"""The vision engine's embeddings equal the monolithic model's image features; bad weights are clear errors."""

from __future__ import annotations

import asyncio
import functools
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

import pytest
import torch

from backends.executors import InvalidInput
from backends.torch_models import load_model
from backends.torch_vision import TorchEncoder
from backends.vision_executor import VisionExecutor
from common.catalog import load_catalog
from common.errors import ConfigError
from common.wire import engine_pb2
from testkit.harness import ROOT, finished, image_bytes
from tests.torch_engines.conftest import TINY, TINY_QWEN
from tests.torch_engines.reference import Reference


@pytest.mark.parametrize("dtype, atol", [("float32", 0.0), ("bfloat16", 0.0)])
def test_embeddings_equal_the_monolithic_image_features(tiny_model_dir: Path, dtype: str, atol: float) -> None:
    """Same weights, same dtype, same preprocessing: bit-equal features (tolerance 0 in float32 and bfloat16),
    and the bytes on the wire decode back to the same tensor."""
    profile = load_catalog().model(TINY)
    vision = TorchEncoder(load_model(profile, model_path=str(tiny_model_dir), seed=0, dtype=dtype, device="cpu",
                                     keep="vision"), profile)
    ref = Reference(tiny_model_dir)
    ref.model.to(getattr(torch, dtype))
    imgs = [image_bytes("PNG", size, noise=True, seed=i) for i, size in enumerate([(40, 30), (64, 64), (9, 70)])]
    encoded, _ = vision.encode_now([engine_pb2.Image(data=b, tokens=16) for b in imgs])
    pixels = ref.inputs("x", imgs)["pixel_values"].to(getattr(torch, dtype))
    with torch.inference_mode():
        want = ref.model.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                                  vision_feature_select_strategy="default").pooler_output
    for enc, feats in zip(encoded, want, strict=True):
        assert (enc.tokens, enc.hidden, enc.dtype) == (16, 64, dtype)
        got = torch.frombuffer(bytearray(enc.payload()), dtype=getattr(torch, dtype)).view(16, 64)
        assert torch.allclose(got.float(), feats.float(), atol=atol, rtol=0)


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    profile = load_catalog().model(TINY)
    with pytest.raises(ConfigError, match=str(tmp_path / "config.json")):
        load_model(profile, model_path=str(tmp_path), seed=0, dtype="auto", device="cpu", keep="both")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_model(profile, model_path=str(tmp_path), seed=0, dtype="auto", device="cpu", keep="both")


@dataclass
class RefusedEngines:
    """Torch engines that start-up must refuse: one given a model path that does not exist, one a device
    the machine lacks."""

    missing: Path
    missing_model: Popen[str]
    absent_device: Popen[str]


@pytest.fixture(scope="module")
def refused_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefusedEngines]:
    """Both started at once: each spends seconds importing torch before it gets that far, and those imports
    overlap instead of adding up. Each test waits for its own."""
    missing = tmp_path_factory.mktemp("refused") / "no-such-model"

    def engine(*args: str) -> Popen[str]:
        return Popen([sys.executable, "-m", "backends.engine", "--backend-id", "x", "--gpu", "H100", "--model", TINY,
                      "--gateway", "127.0.0.1:1", "--executor", "torch", *args],
                     cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    engines = RefusedEngines(missing, engine("--model-path", str(missing)),
                             engine("--random-weights", "--device", "cuda:99"))
    yield engines
    for proc in (engines.missing_model, engines.absent_device):   # one whose test did not run
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def exited(proc: Popen[str]) -> subprocess.CompletedProcess[str]:
    """The process's exit status and output, once it exits (within 120 s)."""
    return finished(proc, 120)


def test_engine_with_a_missing_model_path_exits_naming_it(refused_engines: RefusedEngines) -> None:
    missing = refused_engines.missing
    proc = exited(refused_engines.missing_model)
    assert proc.returncode != 0
    assert str(missing / "config.json") in proc.stderr and "Traceback" not in proc.stderr


def test_qwen_embeddings_equal_the_monolithic_image_features(tiny_qwen_dir: Path) -> None:
    """Qwen2.5-VL: variable token counts per image (the catalog's count is what the encoder makes)."""
    profile = load_catalog().model(TINY_QWEN)
    vision = TorchEncoder(load_model(profile, model_path=str(tiny_qwen_dir), seed=0, dtype="float32", device="cpu",
                                     keep="vision"), profile)
    ref = Reference(tiny_qwen_dir)
    sizes = [(40, 30), (100, 48), (120, 120)]
    imgs = [image_bytes("PNG", size, noise=True, seed=i) for i, size in enumerate(sizes)]
    encoded, _ = vision.encode_now([engine_pb2.Image(data=b) for b in imgs])
    inputs = ref.inputs("x", imgs)
    with torch.inference_mode():
        want = ref.model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_grid_thw=inputs["image_grid_thw"]).pooler_output
    assert [e.tokens for e in encoded] == [profile.image_tokens(*s) for s in sizes] == [f.shape[0] for f in want]
    for enc, feats in zip(encoded, want, strict=True):
        got = torch.frombuffer(bytearray(enc.payload()), dtype=torch.float32).view(enc.tokens, enc.hidden)
        assert torch.equal(got, feats)


def test_an_image_the_processor_refuses_is_invalid_input(tiny_qwen_dir: Path) -> None:
    """Qwen2.5-VL's processor refuses an aspect ratio over 200: the engine answers INVALID_ARGUMENT (the request's
    fault, a 400) rather than an unknown error that counts against the vision engine."""
    profile = load_catalog().model(TINY_QWEN)
    vision = TorchEncoder(load_model(profile, model_path=str(tiny_qwen_dir), seed=0, dtype="float32", device="cpu",
                                     keep="vision"), profile)
    with pytest.raises(InvalidInput, match="aspect ratio"):
        vision.encode_now([engine_pb2.Image(data=image_bytes("PNG", (1, 500)))])


def test_an_image_too_large_to_pad_is_invalid_input(tiny_model_dir: Path) -> None:
    """LLaVA's processor pads to a square: 4,000,000 x 1 pixels asks it for 48 TB, a MemoryError at once. That
    is the request's fault (INVALID_ARGUMENT, a 400; its batch's other requests encoded again without it),
    not an unknown error that counts against the vision engine. The gateway refuses such shapes before."""
    profile = load_catalog().model(TINY)
    vision = TorchEncoder(load_model(profile, model_path=str(tiny_model_dir), seed=0, dtype="float32", device="cpu",
                                     keep="vision"), profile)
    with pytest.raises(InvalidInput, match="could not allocate"):
        vision.encode_now([engine_pb2.Image(data=image_bytes("PNG", (4_000_000, 1)))])


def broken_jpeg() -> bytes:
    """A JPEG whose header, size and end marker are fine (the gateway's inspection passes it) but whose scan data
    is noise: Pillow fails only when it decodes the pixels, in the vision engine."""
    data = bytearray(image_bytes("JPEG", (200, 150), noise=True))
    rng = random.Random(1)
    for i in range(len(data) // 3, len(data) // 3 + 400):
        data[i] = rng.randrange(256)
    return bytes(data)


async def test_a_bad_image_fails_only_its_own_request_in_a_batch(tiny_model_dir: Path) -> None:
    """Requests from different clients share an aligned batch; one image that does not decode fails its own
    request, and the others in the batch get their embeddings (they were failed with its error)."""
    profile = load_catalog().model(TINY)
    encoder = TorchEncoder(load_model(profile, model_path=str(tiny_model_dir), seed=0, dtype="auto", device="cpu",
                                      keep="vision"), profile)
    vision = VisionExecutor(encoder, lambda _to, _emb: asyncio.sleep(0), max_images=8, batch_timeout_s=60)
    tokens = profile.image_tokens(64, 64)
    datas = [image_bytes("PNG", (64, 64), noise=True, seed=1), broken_jpeg(), image_bytes("PNG", (64, 64), seed=2)]
    calls = [asyncio.ensure_future(vision.encode(engine_pb2.EncodeRequest(
        request_id=f"r{i}", images=[engine_pb2.Image(data=data, tokens=tokens)]))) for i, data in enumerate(datas)]
    await asyncio.sleep(0)
    await vision.run_batch()   # all three in one batch
    good, bad, other = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(bad, OSError)
    assert isinstance(good, engine_pb2.EncodeReply) and isinstance(other, engine_pb2.EncodeReply)
    assert [len(r.embeddings) for r in (good, other)] == [1, 1] and vision.images_encoded == 2



def tiny_encoder(tiny_model_dir: Path, features: Callable[..., Any]) -> TorchEncoder:
    """The tiny LLaVA's encoder with its vision tower and projector (`get_image_features`) replaced by
    `features(original, **kwargs)`."""
    profile = load_catalog().model(TINY)
    encoder = TorchEncoder(load_model(profile, model_path=str(tiny_model_dir), seed=0, dtype="auto", device="cpu",
                                      keep="vision"), profile)
    model = encoder.loaded.model.model
    original = model.get_image_features
    model.get_image_features = functools.partial(features, original)
    return encoder


def encode_calls(vision: VisionExecutor, datas: list[bytes]) -> list[asyncio.Future[engine_pb2.EncodeReply]]:
    tokens = load_catalog().model(TINY).image_tokens(64, 64)
    return [asyncio.ensure_future(vision.encode(engine_pb2.EncodeRequest(
        request_id=f"r{i}", images=[engine_pb2.Image(data=data, tokens=tokens)]))) for i, data in enumerate(datas)]


async def test_an_encoder_failure_fails_the_batch_once(tiny_model_dir: Path) -> None:
    """A failure no image causes (the device fails the vision tower) fails every request of the batch with it at
    once: encoding each request again would fail as often, keeping them all waiting (and counted in the backlog)."""
    calls = 0

    def broken(original: Callable[..., Any], **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    vision = VisionExecutor(tiny_encoder(tiny_model_dir, broken), deliver_nowhere, max_images=8, batch_timeout_s=60)
    jobs = encode_calls(vision, [image_bytes("PNG", (64, 64), seed=i) for i in range(3)])
    await asyncio.sleep(0)
    await vision.run_batch()
    results = await asyncio.gather(*jobs, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert calls == 1 and vision.backlog_tokens == 0 and vision.images_encoded == 0


async def test_a_failed_batch_hands_out_each_result_as_it_exists(tiny_model_dir: Path) -> None:
    """A batch a bad image fails is encoded again request by request: a good request's embeddings go out while
    the later ones are still being encoded, and a request whose caller has left by then is not encoded again."""
    proceed = threading.Event()
    calls = 0

    def features(original: Callable[..., Any], **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:   # the second good request: held until the first has its reply
            assert proceed.wait(timeout=60)
        return original(**kwargs)

    vision = VisionExecutor(tiny_encoder(tiny_model_dir, features), deliver_nowhere, max_images=8,
                            batch_timeout_s=60)
    good, bad, later, gone = encode_calls(vision, [image_bytes("PNG", (64, 64), noise=True, seed=1), broken_jpeg(),
                                                   image_bytes("PNG", (64, 64), seed=2),
                                                   image_bytes("PNG", (64, 64), seed=3)])
    await asyncio.sleep(0)
    batch = asyncio.create_task(vision.run_batch())
    try:
        reply = await asyncio.wait_for(asyncio.shield(good), timeout=60)   # while `later` is being encoded
        gone.cancel()
    finally:
        proceed.set()
    await batch
    [failure] = await asyncio.gather(bad, return_exceptions=True)
    assert len(reply.embeddings) == 1 and isinstance(failure, OSError)
    assert len((await later).embeddings) == 1 and gone.cancelled()
    assert calls == 2 and vision.images_encoded == 2 and vision.backlog_tokens == 0


async def deliver_nowhere(_to: str, _emb: engine_pb2.Embedding) -> None:
    """No embedding in these tests names a language engine to deliver it to."""


def test_engine_on_a_device_it_lacks_exits_naming_it(refused_engines: RefusedEngines) -> None:
    """A CUDA device the machine does not have stops start-up with one line naming it (not torch's assertion
    from inside its lazy CUDA start-up, which the launching gateway would restart forever behind a traceback)."""
    proc = exited(refused_engines.absent_device)
    assert proc.returncode != 0
    assert "device 'cuda:99' does not exist here" in proc.stderr and "Traceback" not in proc.stderr
