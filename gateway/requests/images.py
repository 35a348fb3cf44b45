"""Image inputs: data URLs (and, when enabled, http(s) URLs) to validated images with a token count.

Only the image header is parsed (Pillow opens lazily and reads the size without decoding pixels; the
pixel limit is the configured one, Pillow's raised to it where lower); `verify()` then checks the file
structure (a PNG's chunks and their checksums; a JPEG's end marker is checked here), so a truncated or
malformed file is a 400 here rather than a failure inside an engine. Pixel data is not decoded here (a
few milliseconds a megapixel of the gateway's one loop): a file whose structure holds but whose
compressed data does not decode is refused by the engine that encodes it, with a 400 ("image could not
be decoded") that does not name the content part. Remote fetches refuse loopback, private, link-local
and other non-global addresses unless the config allows them, follow no redirects, and stop at the byte
limit. Each image carries its content hash, computed where its bytes are inspected (off the event loop
for large ones).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import re
import socket
import warnings
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from PIL import Image, UnidentifiedImageError
from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from common.catalog import ModelProfile
from common.prefix_blocks import content_digest, salted_digest
from common.yaml_files import StrictModel
from gateway.requests.errors import InvalidRequest

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
INLINE_INSPECT_BYTES = 256 << 10
MAX_ASPECT_RATIO = 200   # Qwen2-VL's smart_resize refuses longer sides than this many times the shorter


class ImageLimits(StrictModel):
    max_images: NonNegativeInt = 8         # per request; 0: text only
    max_image_bytes: PositiveInt = 10 << 20
    max_image_pixels: PositiveInt = 4096 * 4096
    remote_urls: bool = False              # fetch http(s) image URLs at all
    allow_private_addresses: bool = False  # let remote URLs reach loopback/private/link-local hosts
    fetch_timeout_s: PositiveFloat = 5.0


@dataclass(frozen=True, slots=True)
class ImageInput:
    data: bytes
    width: int
    height: int
    format: str
    tokens: int
    salt: str = ""   # the request's cache salt: the same image under another salt is another image
    # The content hash (common.prefix_blocks.content_digest, salted): the same image is the same digest
    # in every request of a salt, which is how the prefix index and the encoders' index recognise it.
    digest: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", salted_digest(content_digest(self.data), self.salt))


def inspect(data: bytes, where: str, limits: ImageLimits, model: ModelProfile, salt: str = "") -> ImageInput:
    """Validate one image file and count its vision tokens; errors name `where` (the content part)."""
    if len(data) > limits.max_image_bytes:
        raise InvalidRequest(f"{where}: image is {len(data)} bytes; the limit is {limits.max_image_bytes}", param=where)
    if Image.MAX_IMAGE_PIXELS is not None and limits.max_image_pixels > Image.MAX_IMAGE_PIXELS:
        # Pillow refuses a file past twice its own limit (~179 million pixels) when it opens it: raised (never
        # lowered, the process's other Pillow users keep its check) to the configured limit, which holds; its
        # warning past the limit is then this function's own refusal, said once more on stderr: not shown.
        Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning, module="PIL")
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt, (width, height) = img.format or "", img.size
            img.verify()
    except Image.DecompressionBombError as exc:   # twice the limit or more: refused before its size is read here
        size = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = size.group(1) if size else "too many"
        raise InvalidRequest(f"{where}: image has {pixels} pixels; the limit is {limits.max_image_pixels} pixels",
                             param=where) from None
    except UnidentifiedImageError:
        raise InvalidRequest(f"{where}: not a PNG, JPEG or WebP image", param=where) from None
    except Exception as exc:   # Pillow's parsers raise more than OSError on a damaged file (IndexError, struct.error)
        raise InvalidRequest(f"{where}: image is corrupt or truncated ({type(exc).__name__}: {exc})",
                             param=where) from None
    if fmt == "JPEG" and not data.rstrip(b"\x00").endswith(b"\xff\xd9"):   # verify() does not check JPEG
        raise InvalidRequest(f"{where}: image is corrupt or truncated (JPEG without an end marker)", param=where)
    if fmt not in FORMATS:
        raise InvalidRequest(f"{where}: {fmt or 'unknown'} images are not supported (PNG, JPEG, WebP)", param=where)
    if width * height > limits.max_image_pixels:
        raise InvalidRequest(
            f"{where}: image is {width}x{height} pixels; the limit is {limits.max_image_pixels} pixels", param=where
        )
    check_shape(width, height, where, model, limits)
    return ImageInput(data, width, height, fmt, model.image_tokens(width, height), salt)


def check_shape(width: int, height: int, where: str, model: ModelProfile, limits: ImageLimits) -> None:
    """A dynamic-resolution model (Qwen2-VL family) cannot take every shape: its image processor refuses an
    aspect ratio over 200, and a side of at most half a token (14 px) rounds to no token there, where the
    catalog's token count (`ModelProfile.image_tokens`) gives it one, so the encoder would make another
    number of tokens than the prompt holds. A fixed-resolution model (LLaVA) pads the image to a square
    before resizing it: a 16,777,216 x 1 image (within max_image_pixels) became a 16,777,216-pixel square
    that the engine could not allocate. Each reaching an engine failed the request there as the engine's
    fault (a 502, the backend marked failing, the other requests of its encode batch failed with it);
    here it is the client's 400 that says why."""
    vision = model.vision
    if vision is None:
        return
    if vision.mode != "dynamic":
        side = max(width, height)
        if side * side > limits.max_image_pixels:
            raise InvalidRequest(f"{where}: image is {width}x{height} pixels; {model.name} pads it to a {side}x{side} "
                                 f"square, over the limit of {limits.max_image_pixels} pixels", param=where)
        return
    short, long = sorted((width, height))
    if long > MAX_ASPECT_RATIO * short:
        raise InvalidRequest(f"{where}: image is {width}x{height} pixels; {model.name} takes aspect ratios up to "
                             f"{MAX_ASPECT_RATIO}:1", param=where)
    if 2 * short <= vision.pixels_per_token_side < 2 * long:
        raise InvalidRequest(f"{where}: image is {width}x{height} pixels; {model.name} cannot take a side of "
                             f"{vision.pixels_per_token_side // 2} pixels or less next to a longer one", param=where)


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"   # URL schemes are case-insensitive (RFC 3986)


def decode_data_url(url: str, where: str, limits: ImageLimits) -> bytes:
    """The bytes of a base64 data URL. Line breaks and spaces in the payload (MIME base64, as Python's
    `base64.encodebytes` writes it) are skipped; any other character outside the alphabet is refused."""
    header, sep, payload = url.partition(",")
    if not sep or not is_data_url(header) or not header.lower().endswith(";base64"):
        raise InvalidRequest(f"{where}: data URLs must look like data:image/png;base64,...", param=where)
    if len(payload) > (limits.max_image_bytes * 4) // 3 + 4:
        raise InvalidRequest(f"{where}: image is over the limit of {limits.max_image_bytes} bytes", param=where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:   # the rare payload with whitespace: checked again without it (a second pass only then)
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: data URL payload is not valid base64", param=where) from None


async def check_public_host(host: str, port: int, where: str) -> None:
    """Refuse hosts that resolve to any non-global address (SSRF guard)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise InvalidRequest(f"{where}: cannot resolve image host {host!r}", param=where) from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0])
        if not addr.is_global:
            raise InvalidRequest(
                f"{where}: image URL host {host!r} resolves to a non-public address; refused", param=where
            )


async def fetch(url: str, where: str, limits: ImageLimits, client: httpx.AsyncClient) -> bytes:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"{where}: image URL must be a data: URL or an http(s) URL", param=where)
    if not limits.remote_urls:
        raise InvalidRequest(
            f"{where}: remote image URLs are disabled on this gateway; send the image as a data: URL", param=where
        )
    if not limits.allow_private_addresses:
        await check_public_host(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), where)
    try:   # fetch_timeout_s bounds the whole download: as httpx's timeout it bounds each read, and a
        # server sending a byte every few seconds held a request for up to request_timeout_s
        async with asyncio.timeout(limits.fetch_timeout_s), \
                client.stream("GET", url, timeout=limits.fetch_timeout_s, follow_redirects=False) as resp:
            if resp.status_code != 200:
                raise InvalidRequest(f"{where}: fetching the image URL gave HTTP {resp.status_code}", param=where)
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise InvalidRequest(f"{where}: image is over {limits.max_image_bytes} bytes", param=where)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"{where}: fetching the image URL failed: {type(exc).__name__}", param=where) from None
    except TimeoutError:
        raise InvalidRequest(f"{where}: fetching the image URL took more than {limits.fetch_timeout_s} s "
                             "(images.fetch_timeout_s)", param=where) from None
    return b"".join(chunks)


async def load_image(url: str, where: str, limits: ImageLimits, model: ModelProfile, client: httpx.AsyncClient,
                     salt: str = "") -> ImageInput:
    data = decode_data_url(url, where, limits) if is_data_url(url) else await fetch(url, where, limits, client)
    if len(data) > INLINE_INSPECT_BYTES:   # verify() reads the whole file: keep big ones off the loop
        return await asyncio.to_thread(inspect, data, where, limits, model, salt)
    return inspect(data, where, limits, model, salt)
