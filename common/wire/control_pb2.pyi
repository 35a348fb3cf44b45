from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_LANGUAGE: _ClassVar[Role]
    ROLE_VISION: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]

class KvCapacitySource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CAPACITY_SOURCE_UNSPECIFIED: _ClassVar[KvCapacitySource]
    KV_CAPACITY_SOURCE_ENGINE: _ClassVar[KvCapacitySource]
    KV_CAPACITY_SOURCE_CONFIG: _ClassVar[KvCapacitySource]
    KV_CAPACITY_SOURCE_ESTIMATE: _ClassVar[KvCapacitySource]
ROLE_UNSPECIFIED: Role
ROLE_LANGUAGE: Role
ROLE_VISION: Role
ROLE_BOTH: Role
KV_CAPACITY_SOURCE_UNSPECIFIED: KvCapacitySource
KV_CAPACITY_SOURCE_ENGINE: KvCapacitySource
KV_CAPACITY_SOURCE_CONFIG: KvCapacitySource
KV_CAPACITY_SOURCE_ESTIMATE: KvCapacitySource

class GpuProfile(_message.Message):
    __slots__ = ("name", "tflops", "bandwidth_gbs", "hbm_gb", "price_per_hour")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TFLOPS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GBS_FIELD_NUMBER: _ClassVar[int]
    HBM_GB_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tflops: float
    bandwidth_gbs: float
    hbm_gb: float
    price_per_hour: float
    def __init__(self, name: _Optional[str] = ..., tflops: _Optional[float] = ..., bandwidth_gbs: _Optional[float] = ..., hbm_gb: _Optional[float] = ..., price_per_hour: _Optional[float] = ...) -> None: ...

class BackendState(_message.Message):
    __slots__ = ("backend_id", "role", "address", "model", "gpu", "queue_depth", "running", "kv_free_bytes", "kv_total_bytes", "vision_backlog", "mean_service_s", "seq", "steal", "tokens_generated", "requests_completed", "images_encoded", "pid", "steal_episodes", "tokens_stolen", "embedding_bytes_sent", "max_model_len", "kv_capacity_source", "prefix_cache_queries", "prefix_cache_hits", "embedding_cache_hits", "embedding_cache_images", "scrape_error", "kv_block_tokens")
    BACKEND_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    VISION_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    MEAN_SERVICE_S_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STEAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEAL_EPISODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_STOLEN_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_CACHE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    backend_id: str
    role: Role
    address: str
    model: str
    gpu: GpuProfile
    queue_depth: int
    running: int
    kv_free_bytes: int
    kv_total_bytes: int
    vision_backlog: int
    mean_service_s: float
    seq: int
    steal: bool
    tokens_generated: int
    requests_completed: int
    images_encoded: int
    pid: int
    steal_episodes: int
    tokens_stolen: int
    embedding_bytes_sent: int
    max_model_len: int
    kv_capacity_source: KvCapacitySource
    prefix_cache_queries: int
    prefix_cache_hits: int
    embedding_cache_hits: int
    embedding_cache_images: int
    scrape_error: str
    kv_block_tokens: int
    def __init__(self, backend_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., gpu: _Optional[_Union[GpuProfile, _Mapping]] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., kv_free_bytes: _Optional[int] = ..., kv_total_bytes: _Optional[int] = ..., vision_backlog: _Optional[int] = ..., mean_service_s: _Optional[float] = ..., seq: _Optional[int] = ..., steal: _Optional[bool] = ..., tokens_generated: _Optional[int] = ..., requests_completed: _Optional[int] = ..., images_encoded: _Optional[int] = ..., pid: _Optional[int] = ..., steal_episodes: _Optional[int] = ..., tokens_stolen: _Optional[int] = ..., embedding_bytes_sent: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_capacity_source: _Optional[_Union[KvCapacitySource, str]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., embedding_cache_hits: _Optional[int] = ..., embedding_cache_images: _Optional[int] = ..., scrape_error: _Optional[str] = ..., kv_block_tokens: _Optional[int] = ...) -> None: ...

class GatewayMessage(_message.Message):
    __slots__ = ("ack_seq", "heartbeat_interval_ms")
    ACK_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ack_seq: int
    heartbeat_interval_ms: int
    def __init__(self, ack_seq: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...
