from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Message(_message.Message):
    __slots__ = ("role", "text", "images")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    role: str
    text: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, role: _Optional[str] = ..., text: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "messages", "prompt", "max_tokens", "temperature", "has_temperature", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    HAS_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    prompt: str
    max_tokens: int
    temperature: float
    has_temperature: bool
    request_id: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., has_temperature: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "request_id", "backend", "vision_backend", "cached_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VISION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    request_id: str
    backend: str
    vision_backend: str
    cached_tokens: int
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., backend: _Optional[str] = ..., vision_backend: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
