"""`gateway.autoscaling` settings an operator's audit found taken without a word, as `gateway check-config`
(start-up's own checks) answers them: a language pool's reference request longer than its models' context
(its predicted first token would make an idle pool read as high, and grow it to max), a NaN duration or
mark (named as what it is, not as out of a bound), and manage mode beside replicas, whose fleet is fixed
(the scaler only exports: a warning)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testkit.harness import ROOT, write_config

pytestmark = pytest.mark.timeout(120)


def check(tmp: Path, autoscaling: dict[str, Any], *options: str) -> subprocess.CompletedProcess[str]:
    config = write_config(tmp, {
        "model": "llava-1.5-7b",
        "gateway": {"autoscaling": autoscaling},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {}},
                     {"id": "l4-vision-0", "role": "vision", "gpu": "L4", "launch": {}}],
    })
    return subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(config), *options], cwd=ROOT,
                          capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("mode", ["manage", "export"])
def test_a_reference_request_beyond_the_context_is_refused(tmp_path: Path, mode: str) -> None:
    language = {"min": 1, "max": 2, "ttft_prompt_tokens": 100_000, "ttft_max_tokens": 128,
                **({"gpus": ["H100"]} if mode == "manage" else {})}
    done = check(tmp_path, {"mode": mode, "pools": {"language": language}})
    assert done.returncode == 2
    assert done.stderr.splitlines()[1:] == [
        f"{tmp_path / 'backends.yaml'}: gateway.autoscaling.pools.language.ttft_prompt_tokens: 100000 + "
        "ttft_max_tokens 128 = 100128 tokens, more than the pool's models' context (4096): no engine takes such "
        "a request; give a typical one"]


@pytest.mark.parametrize("where", ["interval_s", "down_delay_s", "low_mark"])
def test_a_nan_is_named_as_not_finite(tmp_path: Path, where: str) -> None:
    language: dict[str, Any] = {"min": 1, "max": 2}
    autoscaling: dict[str, Any] = {"mode": "export", "pools": {"language": language}}
    (language if where == "low_mark" else autoscaling)[where] = float("nan")
    done = check(tmp_path, autoscaling)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].endswith(f"{where}: Input should be a finite number")


def test_manage_mode_beside_replicas_is_warned_about(tmp_path: Path) -> None:
    pools = {"language": {"min": 1, "max": 2, "gpus": ["H100"]}}
    done = check(tmp_path, {"mode": "manage", "pools": pools}, "--redis-url", "redis://127.0.0.1:6379/15")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("gateway: warning: gateway.autoscaling.mode is manage, but with replicas (--redis-url or "
                           "gateway.redis.url) the fleet is fixed: the scaler adds and removes no engine, it only "
                           "exports its counts on /metrics, as mode export does\n")
    alone = check(tmp_path, {"mode": "manage", "pools": pools})
    assert (alone.returncode, alone.stderr) == (0, "")
