from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Timings(_message.Message):
    __slots__ = ("queue_ns", "compute_ns", "transfer_ns", "total_ns", "first_token_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    compute_ns: int
    transfer_ns: int
    total_ns: int
    first_token_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., transfer_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., first_token_ns: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
