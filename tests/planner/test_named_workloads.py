"""The simulator's workloads by name (`--workload`) against the model: its context and whether it takes images."""

from __future__ import annotations

import pytest

from common.catalog import load_catalog
from loadtest.planner import cli
from loadtest.planner.workload import WorkloadError, named_trace, tokens_per_image
from loadtest.sim import workloads

pytestmark = pytest.mark.timeout(120)

CATALOG = load_catalog()


@pytest.mark.parametrize("model", ["llava-1.5-7b", "llava-1.5-tiny"])
@pytest.mark.parametrize("workload", sorted(workloads.WORKLOADS))
def test_every_request_of_a_named_workload_fits_the_models_context(model: str, workload: str) -> None:
    """What the live gateway takes: prompt (text and image tokens) + max_tokens within the context, each image at
    the model's own tokens (llava-1.5-tiny's 16, not LLaVA-1.5-7B's 576)."""
    profile = CATALOG.model(model)
    trace, clipped = named_trace(workload, profile, 5.0, 1000, seed=0)
    lengths = trace.lengths
    assert int((lengths.input_tokens + lengths.max_output_tokens).max()) <= profile.max_context
    assert (lengths.image_tokens == lengths.images * tokens_per_image(profile)).all()
    assert int(lengths.text_tokens.min()) >= 1
    raw = workloads.lengths(workload, 1000, 0)
    needs = raw.text_tokens + raw.images * tokens_per_image(profile) + raw.max_output_tokens
    assert clipped == int((needs > profile.max_context).sum())


def test_a_long_workload_is_clipped_to_the_context_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    _, clipped = named_trace("long_heavy", CATALOG.model("llava-1.5-7b"), 5.0, 1000, seed=0)
    assert clipped == 214           # prompt + max_tokens above 4096: the gateway's 400 context_length_exceeded
    assert cli.main(["--rate", "5", "--budget", "1", "--gpus", "L4", "--max-gpus", "1", "--workload", "long_heavy",
                     "--workers", "1"]) in (0, 1)
    assert "note: --workload long_heavy: " in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--workload", "coco"], ["--workload", "mm_mixed"],
                                   ["--workload", "mm_mixed", "--splits", "monolithic"]])
def test_images_for_a_text_only_model_are_one_line_before_the_search(
        capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert cli.main(["--rate", "5", "--budget", "4", "--model", "llama-2-7b", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"gateway plan: model 'llama-2-7b' takes no images, and workload '{extra[1]}' has")


def test_a_workload_no_prompt_clip_can_fit_is_refused() -> None:
    tiny = CATALOG.model("llava-1.5-tiny").model_copy(update={"max_context": 512})
    with pytest.raises(WorkloadError, match=r"does not fit model 'llava-1\.5-tiny''s context of 512 tokens"):
        named_trace("sharegpt", tiny, 5.0, 200, seed=0)      # max_tokens 512 alone fills it
