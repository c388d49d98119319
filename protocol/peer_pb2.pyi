from murmur.protocol import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_UNSPECIFIED: _ClassVar[Op]
    OP_REDUCE: _ClassVar[Op]
    OP_GATHER: _ClassVar[Op]
OP_UNSPECIFIED: Op
OP_REDUCE: Op
OP_GATHER: Op

class HelloRequest(_message.Message):
    __slots__ = ("protocol_version", "run_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class RoundDone(_message.Message):
    __slots__ = ("round", "key", "result_hash", "members")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESULT_HASH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    round: int
    key: str
    result_hash: bytes
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., key: _Optional[str] = ..., result_hash: _Optional[bytes] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_version", "run_id", "node_id", "done", "states")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    node_id: str
    done: _containers.RepeatedCompositeFieldContainer[RoundDone]
    states: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., node_id: _Optional[str] = ..., done: _Optional[_Iterable[_Union[RoundDone, _Mapping]]] = ..., states: _Optional[_Iterable[str]] = ...) -> None: ...

class ExchangeHeader(_message.Message):
    __slots__ = ("protocol_version", "run_id", "op", "round", "key", "attempt", "members", "sender", "weight", "layout_hash", "span_start", "span_end", "payload_bytes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    SPAN_START_FIELD_NUMBER: _ClassVar[int]
    SPAN_END_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    op: Op
    round: int
    key: str
    attempt: int
    members: _containers.RepeatedScalarFieldContainer[str]
    sender: str
    weight: float
    layout_hash: bytes
    span_start: int
    span_end: int
    payload_bytes: int
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., op: _Optional[_Union[Op, str]] = ..., round: _Optional[int] = ..., key: _Optional[str] = ..., attempt: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., sender: _Optional[str] = ..., weight: _Optional[float] = ..., layout_hash: _Optional[bytes] = ..., span_start: _Optional[int] = ..., span_end: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.WireTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.WireTensor, _Mapping]]] = ...) -> None: ...

class ExchangeFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ExchangeHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ExchangeHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExchangeStatus(_message.Message):
    __slots__ = ("code", "failed", "contributors", "payload_bytes", "result_hash", "reason", "protocol_version", "members", "attempt")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[ExchangeStatus.Code]
        OK: _ClassVar[ExchangeStatus.Code]
        ABORT: _ClassVar[ExchangeStatus.Code]
        ALREADY_DONE: _ClassVar[ExchangeStatus.Code]
        REFUSED: _ClassVar[ExchangeStatus.Code]
    CODE_UNSPECIFIED: ExchangeStatus.Code
    OK: ExchangeStatus.Code
    ABORT: ExchangeStatus.Code
    ALREADY_DONE: ExchangeStatus.Code
    REFUSED: ExchangeStatus.Code
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESULT_HASH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    code: ExchangeStatus.Code
    failed: _containers.ScalarMap[str, str]
    contributors: _containers.RepeatedScalarFieldContainer[str]
    payload_bytes: int
    result_hash: bytes
    reason: str
    protocol_version: int
    members: _containers.RepeatedScalarFieldContainer[str]
    attempt: int
    def __init__(self, code: _Optional[_Union[ExchangeStatus.Code, str]] = ..., failed: _Optional[_Mapping[str, str]] = ..., contributors: _Optional[_Iterable[str]] = ..., payload_bytes: _Optional[int] = ..., result_hash: _Optional[bytes] = ..., reason: _Optional[str] = ..., protocol_version: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., attempt: _Optional[int] = ...) -> None: ...

class ExchangeReply(_message.Message):
    __slots__ = ("status", "data")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    status: ExchangeStatus
    data: bytes
    def __init__(self, status: _Optional[_Union[ExchangeStatus, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("protocol_version", "name", "tensors")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    name: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., name: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("name", "state_hash", "tensors", "members")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state_hash: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., state_hash: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class StateFrame(_message.Message):
    __slots__ = ("manifest", "part")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    manifest: StateManifest
    part: _tensor_pb2.TensorPart
    def __init__(self, manifest: _Optional[_Union[StateManifest, _Mapping]] = ..., part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ...) -> None: ...
