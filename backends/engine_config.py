"""What one engine process runs, as a value: parsed from the command line once, then passed to the factory.

    heterogate-engine --backend-id h100-0 --role language --gpu H100 --model llava-1.5-7b \
        --gateway 127.0.0.1:50061 [--port 0] [--time-scale 1.0] [--executor torch --random-weights]

`executor: simulated` times every step with the performance model (the demo and the simulator's twin);
`executor: torch` runs the model for real from `model_path` (a local Hugging Face directory) or from the
catalog's Hugging Face config with random weights. Nothing is ever downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common import perf_model
from common.catalog import CONFIG_DIR
from common.one_line_parser import OneLineParser, port, positive_float, positive_int, share, targets

Role = Literal["language", "vision", "both"]
Executor = Literal["simulated", "torch"]
TORCH_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    backend_id: str
    gpu: str
    model: str
    gateway: str
    role: Role = "language"
    host: str = "127.0.0.1"
    port: int = 0
    executor: Executor = "simulated"
    time_scale: float = 1.0
    max_batch: int = 256
    memory_utilization: float = perf_model.DEFAULT_MEMORY_UTILIZATION
    heartbeat_ms: int = 200
    steal: bool = False
    steal_episode_ms: float = 100.0
    vision_batch: int = 32
    vision_batch_timeout_ms: float = 50.0
    embedding_cache_images: int = 256   # vision: embeddings kept by content hash (0: no cache)
    # torch executor
    model_path: str | None = None
    random_weights: bool = False
    device: str = "cpu"
    dtype: str = "auto"            # auto: the catalog model's dtype
    seed: int = 0                  # random weights: the same seed gives the same weights in every engine
    max_model_len: int | None = None   # tokens of KV per sequence slot (default: the model's max_context)
    log_level: str = "info"
    orphan_timeout_s: float | None = None   # exit once no gateway has taken the heartbeats for this long
    catalog: Path = CONFIG_DIR     # the catalog folder the GPU and model are looked up in


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    p = OneLineParser(prog="heterogate-engine", description="One GPU's engine for the HeteroGate gateway: a "
                      "simulated or PyTorch model that serves the requests the gateway routes to it and heartbeats "
                      "its load to the gateway's control port.")
    p.add_argument("--backend-id", required=True)
    p.add_argument("--role", choices=("language", "vision", "both"), default="language")
    p.add_argument("--gpu", required=True, help="GPU catalog name, e.g. H100")
    p.add_argument("--catalog", type=Path, default=CONFIG_DIR,
                   help="catalog folder (gpus.yaml, models.yaml) of the GPU and model (default: the built-in one)")
    p.add_argument("--model", required=True, help="model catalog name, e.g. llava-1.5-7b")
    p.add_argument("--gateway", required=True, type=targets,
                   help="host:port of the gateway's control (gRPC) service; several, comma-separated, fail over")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=0)
    p.add_argument("--executor", choices=("simulated", "torch"), default="simulated")
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="multiply every simulated step time by this")
    p.add_argument("--max-batch", type=positive_int, default=256)
    p.add_argument("--memory-utilization", type=share, default=perf_model.DEFAULT_MEMORY_UTILIZATION)
    p.add_argument("--heartbeat-ms", type=positive_int, default=200)
    p.add_argument("--steal", action="store_true", help="vision engine: load the decoder and steal language work")
    p.add_argument("--steal-episode-ms", type=float, default=100.0, help="bound on one stealing step")
    p.add_argument("--vision-batch", type=int, default=32, help="aligned encode batch: images")
    p.add_argument("--vision-batch-timeout-ms", type=float, default=50.0, help="aligned encode batch: wait")
    p.add_argument("--embedding-cache-images", type=int, default=256,
                   help="vision: image embeddings kept by content hash, least recently used out (0: none)")
    p.add_argument("--model-path", default=None, help="torch: local Hugging Face model directory")
    p.add_argument("--random-weights", action="store_true", help="torch: the catalog's HF config, random weights")
    p.add_argument("--device", default="cpu", help="torch: cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=TORCH_DTYPES, default="auto")
    p.add_argument("--seed", type=int, default=0, help="torch: seed of the random weights")
    p.add_argument("--max-model-len", type=positive_int, default=None, help="torch: KV tokens per sequence slot")
    p.add_argument("--log-level", default="info")
    p.add_argument("--orphan-timeout-s", type=float, default=None,
                   help="exit once no gateway has taken this engine's heartbeats for this long (default: never; "
                        "set by gateway replicas for the engines that outlive the replica launching them)")
    a = p.parse_args(argv)
    if a.executor == "torch" and (a.model_path is None) == (not a.random_weights):
        p.error("--executor torch needs exactly one of --model-path and --random-weights")
    return EngineConfig(
        backend_id=a.backend_id, gpu=a.gpu, model=a.model, gateway=a.gateway, role=a.role, host=a.host,
        port=a.port, executor=a.executor, time_scale=a.time_scale, max_batch=a.max_batch,
        memory_utilization=a.memory_utilization, heartbeat_ms=a.heartbeat_ms, steal=a.steal,
        steal_episode_ms=a.steal_episode_ms, vision_batch=a.vision_batch,
        vision_batch_timeout_ms=a.vision_batch_timeout_ms, embedding_cache_images=a.embedding_cache_images,
        model_path=a.model_path,
        random_weights=a.random_weights, device=a.device, dtype=a.dtype, seed=a.seed,
        max_model_len=a.max_model_len, log_level=a.log_level, orphan_timeout_s=a.orphan_timeout_s,
        catalog=a.catalog,
    )
