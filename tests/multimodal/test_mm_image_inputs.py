"""Image inputs: vision-token counting, validation errors that name the offending part, the SSRF guard.

Unit tests of `common.catalog` / `gateway.requests.images` against hand-computed cases, then one real gateway
serving Qwen2.5-VL-7B (dynamic vision tokens) on one language and one vision engine, with small image
limits and remote image URLs switched on (private addresses still refused):

    max_images 3 per request, max_image_bytes 40 000, max_image_pixels 250 000
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.catalog import load_catalog
from gateway.config.cluster import GatewaySettings
from gateway.requests.errors import InvalidRequest
from gateway.requests.images import ImageLimits, decode_data_url, fetch, inspect
from testkit.harness import (
    Gateway,
    ImageServer,
    data_url,
    image_bytes,
    image_part,
    metric_total,
    run_gateway,
    serving_images,
    text_part,
    wait_all_healthy,
    without_images,
    write_config,
)

CATALOG = load_catalog()
LLAVA, QWEN, LLAMA = CATALOG.model("llava-1.5-7b"), CATALOG.model("qwen2.5-vl-7b"), CATALOG.model("llama-2-7b")
QWEN_HIDDEN, BF16_BYTES = 3584, 2
MAX_IMAGES, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS = 3, 40_000, 250_000
CHAT = "/v1/chat/completions"
LANGUAGE, VISION = "l40s-0", "rtx4090-0"

pytestmark = pytest.mark.timeout(60)


# --- token counting (unit) -----------------------------------------------------------------------


@pytest.mark.parametrize("size", [(1, 1), (336, 336), (1000, 10), (4000, 3000)])
def test_llava_is_576_tokens_whatever_the_size(size: tuple[int, int]) -> None:
    assert LLAVA.image_tokens(*size) == 576


# Qwen2.5-VL smart_resize by hand: h' = round(h/28)·28, w' = round(w/28)·28 (Python rounds half to
# even); if h'·w' > max_pixels (12 845 056): β = √(h·w / max), h' = ⌊h/β/28⌋·28, w' likewise; if
# h'·w' < min_pixels (3136): β = √(min / (h·w)), h' = ⌈h·β/28⌉·28, w' likewise; tokens = (h'/28)·(w'/28).
QWEN_CASES = [
    # (width, height, tokens, derivation)
    (224, 224, 64, "8 x 8"),
    (300, 200, 77, "w 10.71 -> 11, h 7.14 -> 7"),
    (448, 336, 192, "16 x 12, already multiples of 28"),
    (640, 480, 391, "w 22.86 -> 23, h 17.14 -> 17"),
    (70, 70, 4, "2.5 rounds to 2 (half to even): 56 x 56 = 3136, exactly min_pixels"),
    (20, 10, 6, "28 x 28 < 3136: beta = sqrt(15.68) = 3.9598; w ceil(2.83) = 3, h ceil(1.41) = 2"),
    (1, 1, 4, "beta = 56: 2 x 2"),
    (3584, 3584, 16384, "128 x 128 = 12 845 056, exactly max_pixels"),
    (5000, 4000, 16302, "4004 x 5012 > max: beta = 1.24781; w floor(143.11) = 143, h floor(114.49) = 114"),
]


@pytest.mark.parametrize(("width", "height", "tokens", "why"), QWEN_CASES)
def test_qwen_dynamic_tokens_match_hand_computed_smart_resize(width: int, height: int, tokens: int, why: str) -> None:
    assert QWEN.image_tokens(width, height) == tokens, why


def test_text_only_model_counts_no_image_tokens() -> None:
    assert LLAMA.image_tokens(640, 480) == 0


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("size", [(1, 1), (336, 336), (517, 83)])
def test_inspect_reads_size_and_format_and_counts_tokens(fmt: str, size: tuple[int, int]) -> None:
    data = image_bytes(fmt, size)
    img = inspect(data, "messages.0.content.1", ImageLimits(), LLAVA)
    assert (img.width, img.height, img.format, img.tokens, img.data) == (*size, fmt, 576, data)
    qwen = inspect(data, "messages.0.content.1", ImageLimits(), QWEN)
    assert qwen.tokens == QWEN.image_tokens(*size)


def test_inspect_counts_qwen_tokens_from_the_real_file() -> None:
    assert inspect(image_bytes("JPEG", (300, 200)), "p", ImageLimits(), QWEN).tokens == 77
    assert inspect(image_bytes("WEBP", (640, 480)), "p", ImageLimits(), QWEN).tokens == 391


# --- validation (unit) ---------------------------------------------------------------------------


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims `width` x `height` pixels (a decompression bomb's calling card)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


SMALL = ImageLimits(max_images=MAX_IMAGES, max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=MAX_IMAGE_PIXELS)


@pytest.mark.parametrize(("data", "fragment"), [
    (b"definitely not an image" * 8, "not a PNG, JPEG or WebP"),
    (image_bytes("GIF", (16, 16)), "GIF images are not supported"),
    (image_bytes("PNG", (600, 500)), "600x500 pixels"),
    (png_claiming(30_000, 30_000), f"image has 900000000 pixels; the limit is {MAX_IMAGE_PIXELS} pixels"),
    (image_bytes("PNG", (150, 150), noise=True), f"the limit is {MAX_IMAGE_BYTES}"),
    (image_bytes("PNG", (64, 64), noise=True)[:5000], "corrupt or truncated"),
], ids=["undecodable", "gif", "too-many-pixels", "bomb-header", "too-many-bytes", "truncated-png"])
def test_inspect_rejects_bad_images_naming_the_part(data: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        inspect(data, "messages.1.content.2", SMALL, QWEN)
    assert info.value.param == "messages.1.content.2"
    assert info.value.message.startswith("messages.1.content.2: ")
    assert fragment in info.value.message


def test_a_pixel_limit_above_pillows_own_is_the_one_that_holds() -> None:
    """Pillow refuses files past twice its own limit (~179 million pixels) when it opens them, its
    decompression-bomb check: a 14,000 x 14,000 image under a configured limit of 200 million was refused
    naming that limit."""
    limits = ImageLimits(max_image_pixels=200_000_000)
    image = inspect(png_claiming(14_000, 14_000), "messages.0.content.1", limits, LLAVA)
    assert (image.width, image.height) == (14_000, 14_000)
    with pytest.raises(InvalidRequest, match="15000x15000 pixels; the limit is 200000000 pixels"):
        inspect(png_claiming(15_000, 15_000), "messages.0.content.1", limits, LLAVA)


# a PNG with its header and no image data: Pillow's verify() raised IndexError on it (a 500 before)
HEADER_ONLY_PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAEAAAABACAAAAACPAi4CAAAAAElFTkSuQmCC")


def test_inspect_rejects_a_png_without_image_data() -> None:
    with pytest.raises(InvalidRequest) as info:
        inspect(HEADER_ONLY_PNG, "messages.0.content.0", ImageLimits(), LLAVA)
    assert info.value.param == "messages.0.content.0" and "corrupt or truncated" in info.value.message


def test_a_fixed_resolution_model_bounds_the_square_it_pads_to() -> None:
    """LLaVA's processor pads to a square: 20,000 x 1 is 20,000 pixels but a 400-million-pixel square there
    (a 16,777,216 x 1 PNG made the engine allocate 768 TiB). A square within the limit is taken."""
    with pytest.raises(InvalidRequest) as info:
        inspect(png_claiming(20_000, 1), "messages.0.content.1", ImageLimits(), LLAVA)
    assert info.value.param == "messages.0.content.1"
    assert "20000x20000 square, over the limit of 16777216 pixels" in info.value.message
    assert inspect(png_claiming(4096, 1), "messages.0.content.1", ImageLimits(), LLAVA).tokens == 576


def test_inspect_rejects_a_truncated_jpeg() -> None:
    """images.py promises that a truncated file is a 400 at the gateway, not a failure inside an engine.

    Pillow's `verify()` checks PNG chunk structure but is a no-op for JPEG, so half a JPEG passes.
    """
    data = image_bytes("JPEG", (64, 64), noise=True)
    with pytest.raises(InvalidRequest) as info:
        inspect(data[: len(data) // 2], "messages.0.content.0", ImageLimits(), LLAVA)
    assert info.value.param == "messages.0.content.0"


@pytest.mark.parametrize(("url", "fragment"), [
    ("data:image/png;base64,iVBORw0KGgo@@@@", "not valid base64"),
    ("data:image/png,iVBORw0KGgo", "data URLs must look like"),
    ("data:image/png;base64," + "A" * 60_000, f"over the limit of {MAX_IMAGE_BYTES} bytes"),
], ids=["bad-base64", "not-base64-url", "oversized-payload"])
def test_data_url_errors_name_the_part(url: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_data_url(url, "messages.0.content.3", SMALL)
    assert info.value.param == "messages.0.content.3" and fragment in info.value.message


def test_remote_urls_and_private_addresses_are_off_by_default() -> None:
    images = GatewaySettings().images
    assert images.remote_urls is False and images.allow_private_addresses is False


async def test_remote_url_is_refused_when_remote_urls_is_off() -> None:
    with serving_images(image_bytes()) as server:
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(InvalidRequest) as info:
                await fetch(server.url(), "messages.0.content.1", ImageLimits(), client)
        assert "remote image URLs are disabled" in info.value.message
        assert info.value.param == "messages.0.content.1"
        assert server.hits == []


async def test_a_remote_image_that_trickles_stops_at_the_fetch_timeout() -> None:
    """fetch_timeout_s bounds the whole download, not each read: a server sending a byte every 0.2 s
    would otherwise hold the request for as long as it keeps sending."""
    done = asyncio.Event()

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: 50\r\n\r\n")
        try:
            for _ in range(50):
                writer.write(b"x")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.2)
                if done.is_set():
                    break
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = ImageLimits(remote_urls=True, allow_private_addresses=True, fetch_timeout_s=1.0)
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(InvalidRequest) as info:
                await fetch(f"http://127.0.0.1:{port}/slow.png", "messages.0.content.1", limits, client)
    finally:
        done.set()
        server.close()
        await server.wait_closed()
    assert info.value.param == "messages.0.content.1"
    assert "took more than 1.0 s (images.fetch_timeout_s)" in info.value.message


# --- the Qwen2.5-VL gateway ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("image_inputs")
    launch = {"time_scale": 0.1}
    config = write_config(tmp, {
        "model": "qwen2.5-vl-7b",
        "gateway": {
            "heartbeat_interval_ms": 100,
            "heartbeat_miss_limit": 20,   # a busy two-core machine can delay heartbeats
            "stealing": {"enabled": False},
            "images": {"max_images": MAX_IMAGES, "max_image_bytes": MAX_IMAGE_BYTES,
                       "max_image_pixels": MAX_IMAGE_PIXELS, "remote_urls": True},
        },
        "backends": [
            {"id": LANGUAGE, "role": "language", "gpu": "L40S", "launch": launch},
            {"id": VISION, "role": "vision", "gpu": "RTX-4090", "launch": launch},
        ],
    })
    with run_gateway(config) as g:
        yield g


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    with serving_images(image_bytes("PNG", (64, 64))) as server:
        yield server


def chat(gw: Gateway, messages: list[dict[str, Any]], max_tokens: int = 3) -> httpx.Response:
    return httpx.post(f"{gw.url}{CHAT}", json={"model": "qwen2.5-vl-7b", "messages": messages,
                                                "max_tokens": max_tokens}, timeout=30)


def with_bad_image(url: str) -> list[dict[str, Any]]:
    """A good image at messages.0.content.1 and the bad one at messages.1.content.2."""
    return [
        {"role": "user", "content": [text_part("first look at this"), image_part(data_url(image_bytes()))]},
        {"role": "user", "content": [text_part("then"), text_part("at this"), image_part(url)]},
    ]


def assert_400(r: httpx.Response, param: str, *fragments: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for f in fragments:
        assert f in err["message"], err
    return str(err["message"])


def test_dynamic_image_tokens_end_to_end(gw: Gateway) -> None:
    wait_all_healthy(gw)
    messages = [{"role": "user", "content": [
        text_part("compare"), image_part(data_url(image_bytes("JPEG", (300, 200)), "image/jpeg")),
        text_part("with"), image_part(data_url(image_bytes("WEBP", (448, 336)), "image/webp")),
    ]}]
    image_tokens = 77 + 192
    text_only = chat(gw, without_images(messages))
    assert text_only.status_code == 200, text_only.text
    text_tokens = text_only.json()["usage"]["prompt_tokens"]
    before = gw.backend(VISION)
    metric_before = metric_total(gw, "heterogate_embedding_bytes_total", backend=VISION)
    r = chat(gw, messages)
    assert r.status_code == 200, r.text
    assert r.headers["x-heterogate-vision-backend"] == VISION and r.headers["x-heterogate-backend"] == LANGUAGE
    assert r.json()["usage"]["prompt_tokens"] == text_tokens + image_tokens
    expected = image_tokens * QWEN_HIDDEN * BF16_BYTES
    gw.wait_until(lambda: gw.backend(VISION)["embedding_bytes_sent"] >= before["embedding_bytes_sent"] + expected)
    after = gw.backend(VISION)
    assert after["embedding_bytes_sent"] - before["embedding_bytes_sent"] == expected
    assert after["images_encoded"] - before["images_encoded"] == 2
    assert metric_total(gw, "heterogate_embedding_bytes_total", backend=VISION) - metric_before == expected


BAD_IMAGES = [
    ("undecodable", data_url(b"definitely not an image" * 8), "not a PNG, JPEG or WebP"),
    ("bad-base64", "data:image/png;base64,iVBORw0KGgo@@@@", "not valid base64"),
    ("gif", data_url(image_bytes("GIF", (16, 16)), "image/gif"), "GIF images are not supported"),
    ("too-many-pixels", data_url(image_bytes("PNG", (600, 500))), "600x500 pixels"),
    ("bomb-header", data_url(png_claiming(30_000, 30_000)), f"the limit is {MAX_IMAGE_PIXELS} pixels"),
    ("too-many-bytes", data_url(image_bytes("PNG", (150, 150), noise=True)), str(MAX_IMAGE_BYTES)),
    ("truncated-png", data_url(image_bytes("PNG", (64, 64), noise=True)[:5000]), "corrupt or truncated"),
    ("not-a-data-url", "data:image/png,abc", "data URLs must look like"),
    ("ftp-scheme", "ftp://example.com/cat.png", "data: URL or an http(s) URL"),
]


@pytest.mark.parametrize(("url", "fragment"), [c[1:] for c in BAD_IMAGES], ids=[c[0] for c in BAD_IMAGES])
def test_bad_image_is_400_naming_the_offending_part(gw: Gateway, url: str, fragment: str) -> None:
    assert_400(chat(gw, with_bad_image(url)), "messages.1.content.2", "messages.1.content.2", fragment)


def test_data_urls_as_other_encoders_write_them_are_taken(gw: Gateway) -> None:
    """An upper-case scheme (schemes are case-insensitive) and MIME base64 with line breaks (Python's
    `base64.encodebytes`) are the same image: the same tokens as the plain data URL."""
    png = image_bytes("PNG", (64, 64))
    plain = chat(gw, [{"role": "user", "content": [text_part("look"), image_part(data_url(png))]}])
    assert plain.status_code == 200, plain.text
    for url in ("DATA:image/png;BASE64," + base64.b64encode(png).decode(),
                "data:image/png;base64," + base64.encodebytes(png).decode()):
        r = chat(gw, [{"role": "user", "content": [text_part("look"), image_part(url)]}])
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_an_image_url_given_as_a_bare_string_is_taken(gw: Gateway) -> None:
    """`"image_url": "<url>"` without the object around it: OpenAI and vLLM take it, so clients send it."""
    url = data_url(image_bytes("PNG", (64, 64)))
    shaped = chat(gw, [{"role": "user", "content": [text_part("look"), image_part(url)]}])
    bare = chat(gw, [{"role": "user", "content": [text_part("look"), {"type": "image_url", "image_url": url}]}])
    assert shaped.status_code == bare.status_code == 200, bare.text
    assert bare.json()["usage"]["prompt_tokens"] == shaped.json()["usage"]["prompt_tokens"]
    assert chat(gw, [{"role": "user", "content": [{"type": "image_url", "image_url": 7}]}]).status_code == 400


def test_truncated_jpeg_is_400_naming_the_part(gw: Gateway) -> None:
    data = image_bytes("JPEG", (64, 64), noise=True)
    assert_400(chat(gw, with_bad_image(data_url(data[: len(data) // 2], "image/jpeg"))), "messages.1.content.2")


def test_too_many_images_per_request_is_400(gw: Gateway) -> None:
    url = data_url(image_bytes())
    messages = [
        {"role": "user", "content": [text_part("a"), image_part(url), image_part(url)]},
        {"role": "user", "content": [image_part(url), text_part("b"), image_part(url)]},
    ]
    assert_400(chat(gw, messages), "messages", f"4 images; the limit is {MAX_IMAGES}")
    assert chat(gw, messages[:1]).status_code == 200   # two are fine


def test_rejected_images_never_reach_an_engine(gw: Gateway) -> None:
    before = {b["id"]: b for b in gw.backends()}
    for _, url, _ in BAD_IMAGES:
        assert chat(gw, [{"role": "user", "content": [text_part("x"), image_part(url)]}]).status_code == 400
    r = chat(gw, [{"role": "user", "content": [text_part("x"), image_part(data_url(image_bytes("PNG", (56, 56))))]}])
    assert r.status_code == 200, r.text
    # Heartbeats are ordered: once the good request shows, anything dispatched before it would too.
    gw.wait_until(lambda: gw.backend(VISION)["images_encoded"] > before[VISION]["images_encoded"])
    gw.wait_until(lambda: gw.backend(LANGUAGE)["requests_completed"] > before[LANGUAGE]["requests_completed"])
    after = {b["id"]: b for b in gw.backends()}
    assert after[VISION]["images_encoded"] == before[VISION]["images_encoded"] + 1
    assert after[VISION]["embedding_bytes_sent"] == before[VISION]["embedding_bytes_sent"] + 4 * QWEN_HIDDEN * 2
    assert after[LANGUAGE]["requests_completed"] == before[LANGUAGE]["requests_completed"] + 1


PRIVATE_URLS = [
    ("loopback", "http://127.0.0.1:{port}/cat.png"),
    ("localhost", "http://localhost:{port}/cat.png"),
    ("loopback-https", "https://127.0.0.1:{port}/cat.png"),
    ("loopback-userinfo", "http://user:pw@127.0.0.1:{port}/cat.png"),
    ("loopback-short", "http://127.1:{port}/cat.png"),
    ("loopback-decimal", "http://2130706433:{port}/cat.png"),
    ("unspecified", "http://0.0.0.0:{port}/cat.png"),
    ("ipv6-loopback", "http://[::1]:{port}/cat.png"),
    ("ipv4-mapped-ipv6", "http://[::ffff:127.0.0.1]:{port}/cat.png"),
    ("private-10", "http://10.0.0.7/cat.png"),
    ("private-192-168", "http://192.168.1.1:8080/cat.png"),
    ("link-local-metadata", "http://169.254.169.254/latest/meta-data/"),
]


@pytest.mark.parametrize("template", [u for _, u in PRIVATE_URLS], ids=[n for n, _ in PRIVATE_URLS])
def test_ssrf_guard_refuses_non_public_hosts(gw: Gateway, image_server: ImageServer, template: str) -> None:
    url = template.format(port=image_server.port)
    hits = len(image_server.hits)
    message = assert_400(chat(gw, with_bad_image(url)), "messages.1.content.2")
    assert "non-public address" in message or "cannot resolve" in message, message
    assert len(image_server.hits) == hits, f"the gateway connected to {url}: {image_server.hits}"
