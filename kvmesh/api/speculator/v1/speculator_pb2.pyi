from kvmesh.api.common.v1 import accounting_pb2 as _accounting_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("context", "finished", "batch")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    context: ContextUpdate
    finished: RequestFinished
    batch: UpdateBatch
    def __init__(self, context: _Optional[_Union[ContextUpdate, _Mapping]] = ..., finished: _Optional[_Union[RequestFinished, _Mapping]] = ..., batch: _Optional[_Union[UpdateBatch, _Mapping]] = ...) -> None: ...

class UpdateBatch(_message.Message):
    __slots__ = ("contexts", "finished")
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    contexts: _containers.RepeatedCompositeFieldContainer[ContextUpdate]
    finished: _containers.RepeatedCompositeFieldContainer[RequestFinished]
    def __init__(self, contexts: _Optional[_Iterable[_Union[ContextUpdate, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[RequestFinished, _Mapping]]] = ...) -> None: ...

class ContextUpdate(_message.Message):
    __slots__ = ("request_id", "token_ids", "context_length", "num_draft_tokens", "deadline_us", "accepted_draft_tokens", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    num_draft_tokens: int
    deadline_us: int
    accepted_draft_tokens: int
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., deadline_us: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class RequestFinished(_message.Message):
    __slots__ = ("request_id", "learn")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEARN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    learn: bool
    def __init__(self, request_id: _Optional[str] = ..., learn: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("request_id", "context_length", "draft_token_ids", "timings", "drafts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_length: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    timings: _accounting_pb2.Timings
    drafts: _containers.RepeatedCompositeFieldContainer[Draft]
    def __init__(self, request_id: _Optional[str] = ..., context_length: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ..., drafts: _Optional[_Iterable[_Union[Draft, _Mapping]]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("request_id", "context_length", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_length: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., context_length: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("proposed_tokens", "accepted_tokens", "active_requests", "indexed_tokens")
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    proposed_tokens: int
    accepted_tokens: int
    active_requests: int
    indexed_tokens: int
    def __init__(self, proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., active_requests: _Optional[int] = ..., indexed_tokens: _Optional[int] = ...) -> None: ...
