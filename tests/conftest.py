from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.harness import Gateway, demo_config, run_gateway


@pytest.fixture(scope="session")
def demo_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The default demo cluster (8 simulated language GPUs), clock at 0.2× real time, shared by a session."""
    tmp: Path = tmp_path_factory.mktemp("demo")
    with run_gateway(demo_config(tmp)) as gw:
        yield gw
