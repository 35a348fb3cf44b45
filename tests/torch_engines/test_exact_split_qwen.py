"""Qwen2.5-VL through the split: dynamic image token counts, grids and 3-D M-RoPE positions on the language
engine, and the answer is still token for token the monolithic model's `generate()`.

The tiny random weights are sharpened (`sharp_qwen_dir`, tests/torch_engines/conftest.py): as initialised they
are so flat that greedy decoding answers the same with 1-D or 3-D positions, and a positions bug would pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from testkit.harness import Gateway, image_bytes, run_gateway, write_config
from tests.torch_engines.conftest import TINY_QWEN
from tests.torch_engines.reference import Reference
from tests.torch_engines.split_client import ask_on, client, images, launch, user_message


@pytest.fixture(scope="module")
def qwen_gateway(sharp_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    cfg = write_config(tmp_path_factory.mktemp("split-qwen"), {
        "model": TINY_QWEN,
        "gateway": {"stealing": {"enabled": False}},
        "backends": [
            {"id": "vision-0", "role": "vision", "gpu": "RTX-4090", "launch": launch(sharp_qwen_dir)},
            {"id": "lang-0", "role": "language", "gpu": "H100", "launch": launch(sharp_qwen_dir)},
        ],
    })
    with run_gateway(cfg, timeout=180) as gw:
        yield gw


def test_qwen_split_equals_monolithic_generate(qwen_gateway: Gateway, sharp_qwen_dir: Path) -> None:
    """No image, one, and three of different sizes (4 to 16 tokens each), at once in one batch; the reference
    runs with 3-D positions, and with 1-D positions it answers otherwise (so a positions bug fails here)."""
    reference = Reference(sharp_qwen_dir)
    jobs = [("plain text", images(0), 12), ("one image", images(1, seed=3), 20), ("three", images(3, seed=1), 16)]
    wants = [reference.generate(*job) for job in jobs]
    one_d = [reference.generate(*job, token_types=False) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: ask_on(qwen_gateway, TINY_QWEN, *job)[0], jobs))
    assert got == wants
    assert len({w[1] for w in wants}) == 3   # the prompts really differ in length (dynamic image tokens)
    assert one_d[0] == wants[0]              # text alone: 1-D and 3-D positions are the same ...
    assert any(o[0] != w[0] for o, w in zip(one_d[1:], wants[1:], strict=True))   # ... with images they are not


@pytest.mark.parametrize("size, message", [((1, 500), "aspect ratios up to 200:1"),
                                           ((3, 100), "a side of 14 pixels or less")])
def test_image_shapes_qwen_cannot_take_are_400s(qwen_gateway: Gateway, size: tuple[int, int], message: str) -> None:
    """An image Qwen2.5-VL's processor refuses (aspect over 200), or one whose token count the encoder would make
    otherwise than the prompt holds (a side that rounds to no token), is the client's 400 naming it: it used to
    reach the vision engine, fail there as a 502 and count against the engine; the next request still works."""
    with pytest.raises(openai.BadRequestError, match=message):
        client(qwen_gateway).chat.completions.create(
            model=TINY_QWEN, messages=user_message("x", [image_bytes("PNG", size)]),  # type: ignore[arg-type]
            max_tokens=2, temperature=0,
        )
    assert ask_on(qwen_gateway, TINY_QWEN, "x", images(1), 2)[0][2] == 2
