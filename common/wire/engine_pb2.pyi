from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_tokens", "image_tokens", "max_tokens", "temperature", "embedding_count", "embedding_timeout_ms", "handoff_key", "whole", "image_keys", "token_ids", "image_spans", "top_p", "seed", "stop", "cache_salt", "tag", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_COUNT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_KEY_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SPANS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_tokens: int
    image_tokens: int
    max_tokens: int
    temperature: float
    embedding_count: int
    embedding_timeout_ms: int
    handoff_key: str
    whole: bool
    image_keys: _containers.RepeatedCompositeFieldContainer[ImageKey]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    image_spans: _containers.RepeatedCompositeFieldContainer[ImageSpan]
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    tag: int
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., embedding_count: _Optional[int] = ..., embedding_timeout_ms: _Optional[int] = ..., handoff_key: _Optional[str] = ..., whole: _Optional[bool] = ..., image_keys: _Optional[_Iterable[_Union[ImageKey, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., image_spans: _Optional[_Iterable[_Union[ImageSpan, _Mapping]]] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ..., tag: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("chunks", "ends")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[GenerateChunk]
    ends: _containers.RepeatedCompositeFieldContainer[SessionEnd]
    def __init__(self, chunks: _Optional[_Iterable[_Union[GenerateChunk, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[SessionEnd, _Mapping]]] = ...) -> None: ...

class SessionEnd(_message.Message):
    __slots__ = ("tag", "code", "detail")
    TAG_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    tag: int
    code: int
    detail: str
    def __init__(self, tag: _Optional[int] = ..., code: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ImageSpan(_message.Message):
    __slots__ = ("start", "length", "grid_thw")
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    start: int
    length: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[int] = ..., length: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "index", "finish_reason", "usage", "embedding_wait_s", "relay", "tag")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    text: str
    index: int
    finish_reason: str
    usage: Usage
    embedding_wait_s: float
    relay: bytes
    tag: int
    def __init__(self, text: _Optional[str] = ..., index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., embedding_wait_s: _Optional[float] = ..., relay: _Optional[bytes] = ..., tag: _Optional[int] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "width", "height", "tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    width: int
    height: int
    tokens: int
    def __init__(self, data: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ImageKey(_message.Message):
    __slots__ = ("digest", "tokens", "place")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    digest: int
    tokens: int
    place: int
    def __init__(self, digest: _Optional[int] = ..., tokens: _Optional[int] = ..., place: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "deliver_to", "image_index_offset", "traceparent", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    DELIVER_TO_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDEX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    deliver_to: str
    image_index_offset: int
    traceparent: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., deliver_to: _Optional[str] = ..., image_index_offset: _Optional[int] = ..., traceparent: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("image_tokens", "embedding_bytes", "encode_s", "deliver_s", "embeddings", "images_cached")
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    DELIVER_S_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    image_tokens: int
    embedding_bytes: int
    encode_s: float
    deliver_s: float
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    images_cached: int
    def __init__(self, image_tokens: _Optional[int] = ..., embedding_bytes: _Optional[int] = ..., encode_s: _Optional[float] = ..., deliver_s: _Optional[float] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., images_cached: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("request_id", "image_index", "tokens", "hidden", "dtype", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    image_index: int
    tokens: int
    hidden: int
    dtype: str
    data: bytes
    def __init__(self, request_id: _Optional[str] = ..., image_index: _Optional[int] = ..., tokens: _Optional[int] = ..., hidden: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeliverReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...
