from murmur.protocol import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageFrame(_message.Message):
    __slots__ = ("forward_request", "forward_reply", "backward_request", "backward_reply", "chunk")
    FORWARD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    FORWARD_REPLY_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_REPLY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    forward_request: ForwardRequest
    forward_reply: ForwardReply
    backward_request: BackwardRequest
    backward_reply: BackwardReply
    chunk: PayloadChunk
    def __init__(self, forward_request: _Optional[_Union[ForwardRequest, _Mapping]] = ..., forward_reply: _Optional[_Union[ForwardReply, _Mapping]] = ..., backward_request: _Optional[_Union[BackwardRequest, _Mapping]] = ..., backward_reply: _Optional[_Union[BackwardReply, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ...) -> None: ...

class PayloadChunk(_message.Message):
    __slots__ = ("tensor", "part", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    part: str
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[str] = ..., part: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("protocol_version", "run_id", "stage", "microbatch", "inputs", "reply_codec", "targets", "evaluation")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    stage: int
    microbatch: str
    inputs: _tensor_pb2.WireTensor
    reply_codec: str
    targets: _tensor_pb2.WireTensor
    evaluation: bool
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[str] = ..., inputs: _Optional[_Union[_tensor_pb2.WireTensor, _Mapping]] = ..., reply_codec: _Optional[str] = ..., targets: _Optional[_Union[_tensor_pb2.WireTensor, _Mapping]] = ..., evaluation: _Optional[bool] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("outputs", "compute_s", "loss")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    outputs: _tensor_pb2.WireTensor
    compute_s: float
    loss: float
    def __init__(self, outputs: _Optional[_Union[_tensor_pb2.WireTensor, _Mapping]] = ..., compute_s: _Optional[float] = ..., loss: _Optional[float] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("protocol_version", "run_id", "stage", "microbatch", "inputs", "grad_outputs", "targets", "reply_codec", "run_tokens_committed")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    stage: int
    microbatch: str
    inputs: _tensor_pb2.WireTensor
    grad_outputs: _tensor_pb2.WireTensor
    targets: _tensor_pb2.WireTensor
    reply_codec: str
    run_tokens_committed: int
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch: _Optional[str] = ..., inputs: _Optional[_Union[_tensor_pb2.WireTensor, _Mapping]] = ..., grad_outputs: _Optional[_Union[_tensor_pb2.WireTensor, _Mapping]] = ..., targets: _Optional[_Union[_tensor_pb2.WireTensor, _Mapping]] = ..., reply_codec: _Optional[str] = ..., run_tokens_committed: _Optional[int] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("grad_inputs", "loss", "stepped", "optimizer_steps", "compute_s")
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    grad_inputs: _tensor_pb2.WireTensor
    loss: float
    stepped: bool
    optimizer_steps: int
    compute_s: float
    def __init__(self, grad_inputs: _Optional[_Union[_tensor_pb2.WireTensor, _Mapping]] = ..., loss: _Optional[float] = ..., stepped: _Optional[bool] = ..., optimizer_steps: _Optional[int] = ..., compute_s: _Optional[float] = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("node_id", "run_id", "stage", "stages", "first_block", "end_block", "samples_per_s", "queue", "forwards", "backwards", "optimizer_steps", "samples_total", "refused")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARDS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    stage: int
    stages: int
    first_block: int
    end_block: int
    samples_per_s: float
    queue: int
    forwards: int
    backwards: int
    optimizer_steps: int
    samples_total: int
    refused: int
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., stage: _Optional[int] = ..., stages: _Optional[int] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., samples_per_s: _Optional[float] = ..., queue: _Optional[int] = ..., forwards: _Optional[int] = ..., backwards: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., samples_total: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...
