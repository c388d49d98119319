from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATUS_UNSPECIFIED: _ClassVar[LeaseStatus]
    LEASE_GRANTED: _ClassVar[LeaseStatus]
    LEASE_ALL_DONE: _ClassVar[LeaseStatus]
    LEASE_RUN_FINISHED: _ClassVar[LeaseStatus]
    LEASE_ALL_LEASED: _ClassVar[LeaseStatus]
    LEASE_RUN_PAUSED: _ClassVar[LeaseStatus]
    LEASE_DRIVERS_FULL: _ClassVar[LeaseStatus]
    LEASE_COMMIT_FIRST: _ClassVar[LeaseStatus]
LEASE_STATUS_UNSPECIFIED: LeaseStatus
LEASE_GRANTED: LeaseStatus
LEASE_ALL_DONE: LeaseStatus
LEASE_RUN_FINISHED: LeaseStatus
LEASE_ALL_LEASED: LeaseStatus
LEASE_RUN_PAUSED: LeaseStatus
LEASE_DRIVERS_FULL: LeaseStatus
LEASE_COMMIT_FIRST: LeaseStatus

class Hardware(_message.Message):
    __slots__ = ("device", "cpu_cores", "memory_bytes", "accelerator_memory_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    cpu_cores: int
    memory_bytes: int
    accelerator_memory_bytes: int
    def __init__(self, device: _Optional[str] = ..., cpu_cores: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., accelerator_memory_bytes: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("protocol_version", "token", "csr_pem", "hardware", "peer_address", "name")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    token: str
    csr_pem: bytes
    hardware: Hardware
    peer_address: str
    name: str
    def __init__(self, protocol_version: _Optional[int] = ..., token: _Optional[str] = ..., csr_pem: _Optional[bytes] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., peer_address: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("node_id", "run_id", "certificate_pem", "ca_certificate_pem", "config_toml", "bootstrap_peers", "node_address", "heartbeat_interval_s", "heartbeat_ttl_s", "lease_ttl_s", "tls_server_name", "heartbeat_address", "heartbeat_udp_address", "heartbeat_udp_key")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PEERS_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    TLS_SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UDP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UDP_KEY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    certificate_pem: bytes
    ca_certificate_pem: bytes
    config_toml: str
    bootstrap_peers: _containers.RepeatedScalarFieldContainer[str]
    node_address: str
    heartbeat_interval_s: float
    heartbeat_ttl_s: float
    lease_ttl_s: float
    tls_server_name: str
    heartbeat_address: str
    heartbeat_udp_address: str
    heartbeat_udp_key: bytes
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., certificate_pem: _Optional[bytes] = ..., ca_certificate_pem: _Optional[bytes] = ..., config_toml: _Optional[str] = ..., bootstrap_peers: _Optional[_Iterable[str]] = ..., node_address: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_ttl_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ..., tls_server_name: _Optional[str] = ..., heartbeat_address: _Optional[str] = ..., heartbeat_udp_address: _Optional[str] = ..., heartbeat_udp_key: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("tokens_per_s", "ban_list_version", "state", "incarnation", "peer_address", "round", "state_hash", "stage_peer", "starting", "measured", "view_version")
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BAN_LIST_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    STAGE_PEER_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    tokens_per_s: float
    ban_list_version: int
    state: str
    incarnation: str
    peer_address: str
    round: int
    state_hash: str
    stage_peer: StageReport
    starting: bool
    measured: _containers.RepeatedCompositeFieldContainer[MeasuredRate]
    view_version: int
    def __init__(self, tokens_per_s: _Optional[float] = ..., ban_list_version: _Optional[int] = ..., state: _Optional[str] = ..., incarnation: _Optional[str] = ..., peer_address: _Optional[str] = ..., round: _Optional[int] = ..., state_hash: _Optional[str] = ..., stage_peer: _Optional[_Union[StageReport, _Mapping]] = ..., starting: _Optional[bool] = ..., measured: _Optional[_Iterable[_Union[MeasuredRate, _Mapping]]] = ..., view_version: _Optional[int] = ...) -> None: ...

class MeasuredRate(_message.Message):
    __slots__ = ("node_id", "stage", "samples_per_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    stage: int
    samples_per_s: float
    def __init__(self, node_id: _Optional[str] = ..., stage: _Optional[int] = ..., samples_per_s: _Optional[float] = ...) -> None: ...

class StageReport(_message.Message):
    __slots__ = ("stage", "first_block", "end_block", "address", "state_address", "samples_per_s", "queue", "optimizer_steps", "samples_total", "state_hash", "replica_stage", "replica_hash", "replica_at", "state_source")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_HASH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    stage: int
    first_block: int
    end_block: int
    address: str
    state_address: str
    samples_per_s: float
    queue: int
    optimizer_steps: int
    samples_total: int
    state_hash: str
    replica_stage: int
    replica_hash: str
    replica_at: float
    state_source: str
    def __init__(self, stage: _Optional[int] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., address: _Optional[str] = ..., state_address: _Optional[str] = ..., samples_per_s: _Optional[float] = ..., queue: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., samples_total: _Optional[int] = ..., state_hash: _Optional[str] = ..., replica_stage: _Optional[int] = ..., replica_hash: _Optional[str] = ..., replica_at: _Optional[float] = ..., state_source: _Optional[str] = ...) -> None: ...

class StageOrder(_message.Message):
    __slots__ = ("stage", "reason")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stage: int
    reason: str
    def __init__(self, stage: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class LiveMember(_message.Message):
    __slots__ = ("node_id", "incarnation", "peer_address", "round", "state_hash")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    peer_address: str
    round: int
    state_hash: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., peer_address: _Optional[str] = ..., round: _Optional[int] = ..., state_hash: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("run_state", "leases_renewed", "heartbeat_interval_s", "lease_ttl_s", "ban_list", "ban_list_changed", "members", "run_round", "stage_order", "view_whole", "coordinator_started_at", "kept", "waiting_for_operator", "view_version", "view_unchanged", "view_delta", "view_removed", "heartbeat_address", "heartbeat_udp_address", "heartbeat_udp_key")
    RUN_STATE_FIELD_NUMBER: _ClassVar[int]
    LEASES_RENEWED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    BAN_LIST_FIELD_NUMBER: _ClassVar[int]
    BAN_LIST_CHANGED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RUN_ROUND_FIELD_NUMBER: _ClassVar[int]
    STAGE_ORDER_FIELD_NUMBER: _ClassVar[int]
    VIEW_WHOLE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_OPERATOR_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    VIEW_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    VIEW_DELTA_FIELD_NUMBER: _ClassVar[int]
    VIEW_REMOVED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UDP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UDP_KEY_FIELD_NUMBER: _ClassVar[int]
    run_state: str
    leases_renewed: int
    heartbeat_interval_s: float
    lease_ttl_s: float
    ban_list: BanList
    ban_list_changed: bool
    members: _containers.RepeatedCompositeFieldContainer[LiveMember]
    run_round: int
    stage_order: StageOrder
    view_whole: bool
    coordinator_started_at: float
    kept: KeptState
    waiting_for_operator: str
    view_version: int
    view_unchanged: bool
    view_delta: bool
    view_removed: _containers.RepeatedScalarFieldContainer[str]
    heartbeat_address: str
    heartbeat_udp_address: str
    heartbeat_udp_key: bytes
    def __init__(self, run_state: _Optional[str] = ..., leases_renewed: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ..., ban_list: _Optional[_Union[BanList, _Mapping]] = ..., ban_list_changed: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[LiveMember, _Mapping]]] = ..., run_round: _Optional[int] = ..., stage_order: _Optional[_Union[StageOrder, _Mapping]] = ..., view_whole: _Optional[bool] = ..., coordinator_started_at: _Optional[float] = ..., kept: _Optional[_Union[KeptState, _Mapping]] = ..., waiting_for_operator: _Optional[str] = ..., view_version: _Optional[int] = ..., view_unchanged: _Optional[bool] = ..., view_delta: _Optional[bool] = ..., view_removed: _Optional[_Iterable[str]] = ..., heartbeat_address: _Optional[str] = ..., heartbeat_udp_address: _Optional[str] = ..., heartbeat_udp_key: _Optional[bytes] = ...) -> None: ...

class FrontBeat(_message.Message):
    __slots__ = ("node_id", "request")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    request: bytes
    def __init__(self, node_id: _Optional[str] = ..., request: _Optional[bytes] = ...) -> None: ...

class FrontBatch(_message.Message):
    __slots__ = ("beats",)
    BEATS_FIELD_NUMBER: _ClassVar[int]
    beats: _containers.RepeatedCompositeFieldContainer[FrontBeat]
    def __init__(self, beats: _Optional[_Iterable[_Union[FrontBeat, _Mapping]]] = ...) -> None: ...

class FrontAnswer(_message.Message):
    __slots__ = ("reply", "code", "details")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    reply: bytes
    code: str
    details: str
    def __init__(self, reply: _Optional[bytes] = ..., code: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class FrontAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[FrontAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[FrontAnswer, _Mapping]]] = ...) -> None: ...

class KeptState(_message.Message):
    __slots__ = ("round", "state_hash", "address", "server_name", "kept_at", "stages")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    KEPT_AT_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    round: int
    state_hash: str
    address: str
    server_name: str
    kept_at: float
    stages: _containers.RepeatedCompositeFieldContainer[StageState]
    def __init__(self, round: _Optional[int] = ..., state_hash: _Optional[str] = ..., address: _Optional[str] = ..., server_name: _Optional[str] = ..., kept_at: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageState, _Mapping]]] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("exhausted",)
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    exhausted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, exhausted: _Optional[_Iterable[str]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "shard_id", "shard_name", "start_offset", "end_offset", "expires_at")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_NAME_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    shard_id: int
    shard_name: str
    start_offset: int
    end_offset: int
    expires_at: float
    def __init__(self, lease_id: _Optional[str] = ..., shard_id: _Optional[int] = ..., shard_name: _Optional[str] = ..., start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., expires_at: _Optional[float] = ...) -> None: ...

class AcquireLeaseReply(_message.Message):
    __slots__ = ("granted", "lease", "reason", "status")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    lease: Lease
    reason: str
    status: LeaseStatus
    def __init__(self, granted: _Optional[bool] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., reason: _Optional[str] = ..., status: _Optional[_Union[LeaseStatus, str]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "shard_id", "start_offset", "end_offset", "outer_step", "loss", "bytes_sent", "seconds", "round_members", "val_loss")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    shard_id: int
    start_offset: int
    end_offset: int
    outer_step: int
    loss: float
    bytes_sent: int
    seconds: float
    round_members: _containers.RepeatedScalarFieldContainer[str]
    val_loss: float
    def __init__(self, lease_id: _Optional[str] = ..., shard_id: _Optional[int] = ..., start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., outer_step: _Optional[int] = ..., loss: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., seconds: _Optional[float] = ..., round_members: _Optional[_Iterable[str]] = ..., val_loss: _Optional[float] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("duplicate", "committed_offset", "shard_done", "run_tokens_committed")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHARD_DONE_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    committed_offset: int
    shard_done: bool
    run_tokens_committed: int
    def __init__(self, duplicate: _Optional[bool] = ..., committed_offset: _Optional[int] = ..., shard_done: _Optional[bool] = ..., run_tokens_committed: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseReply(_message.Message):
    __slots__ = ("committed_offset",)
    COMMITTED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    committed_offset: int
    def __init__(self, committed_offset: _Optional[int] = ...) -> None: ...

class ReportCheckpointRequest(_message.Message):
    __slots__ = ("step", "location", "sha256")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    step: int
    location: str
    sha256: str
    def __init__(self, step: _Optional[int] = ..., location: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class ReportCheckpointReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("leases_released", "tokens_committed", "rounds", "run_tokens_committed")
    LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    RUN_TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    leases_released: int
    tokens_committed: int
    rounds: int
    run_tokens_committed: int
    def __init__(self, leases_released: _Optional[int] = ..., tokens_committed: _Optional[int] = ..., rounds: _Optional[int] = ..., run_tokens_committed: _Optional[int] = ...) -> None: ...

class GetBanListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetBootstrapPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckReachableRequest(_message.Message):
    __slots__ = ("peer_address",)
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    peer_address: str
    def __init__(self, peer_address: _Optional[str] = ...) -> None: ...

class CheckReachableReply(_message.Message):
    __slots__ = ("reachable", "reason")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    reason: str
    def __init__(self, reachable: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class BootstrapPeers(_message.Message):
    __slots__ = ("multiaddrs",)
    MULTIADDRS_FIELD_NUMBER: _ClassVar[int]
    multiaddrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, multiaddrs: _Optional[_Iterable[str]] = ...) -> None: ...

class RejectedUpdate(_message.Message):
    __slots__ = ("sender_node_id", "round", "reason")
    SENDER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    sender_node_id: str
    round: int
    reason: str
    def __init__(self, sender_node_id: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportRejectionsRequest(_message.Message):
    __slots__ = ("rejected",)
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedUpdate]
    def __init__(self, rejected: _Optional[_Iterable[_Union[RejectedUpdate, _Mapping]]] = ...) -> None: ...

class ReportRejectionsReply(_message.Message):
    __slots__ = ("recorded",)
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    recorded: int
    def __init__(self, recorded: _Optional[int] = ...) -> None: ...

class ClaimRoundRequest(_message.Message):
    __slots__ = ("round", "key", "members", "run_round", "lost_rounds", "from_round")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RUN_ROUND_FIELD_NUMBER: _ClassVar[int]
    LOST_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    key: str
    members: _containers.RepeatedScalarFieldContainer[str]
    run_round: int
    lost_rounds: bool
    from_round: int
    def __init__(self, round: _Optional[int] = ..., key: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., run_round: _Optional[int] = ..., lost_rounds: _Optional[bool] = ..., from_round: _Optional[int] = ...) -> None: ...

class ClaimRoundReply(_message.Message):
    __slots__ = ("decided", "from_scratch")
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    FROM_SCRATCH_FIELD_NUMBER: _ClassVar[int]
    decided: bool
    from_scratch: bool
    def __init__(self, decided: _Optional[bool] = ..., from_scratch: _Optional[bool] = ...) -> None: ...

class GonePeer(_message.Message):
    __slots__ = ("node_id", "peer_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ...) -> None: ...

class ReportGoneRequest(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[GonePeer]
    def __init__(self, peers: _Optional[_Iterable[_Union[GonePeer, _Mapping]]] = ...) -> None: ...

class ReportGoneReply(_message.Message):
    __slots__ = ("lost", "members", "run_round", "view_whole")
    LOST_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RUN_ROUND_FIELD_NUMBER: _ClassVar[int]
    VIEW_WHOLE_FIELD_NUMBER: _ClassVar[int]
    lost: _containers.RepeatedScalarFieldContainer[str]
    members: _containers.RepeatedCompositeFieldContainer[LiveMember]
    run_round: int
    view_whole: bool
    def __init__(self, lost: _Optional[_Iterable[str]] = ..., members: _Optional[_Iterable[_Union[LiveMember, _Mapping]]] = ..., run_round: _Optional[int] = ..., view_whole: _Optional[bool] = ...) -> None: ...

class BanList(_message.Message):
    __slots__ = ("version", "node_ids")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("config_toml", "manifest_json", "run_id")
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    config_toml: str
    manifest_json: str
    run_id: str
    def __init__(self, config_toml: _Optional[str] = ..., manifest_json: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("run_id", "name", "state", "created_at", "config_toml", "shards_total", "shards_done", "tokens_total", "tokens_committed", "outer_step", "nodes_active")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    SHARDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SHARDS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    NODES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    state: str
    created_at: float
    config_toml: str
    shards_total: int
    shards_done: int
    tokens_total: int
    tokens_committed: int
    outer_step: int
    nodes_active: int
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., created_at: _Optional[float] = ..., config_toml: _Optional[str] = ..., shards_total: _Optional[int] = ..., shards_done: _Optional[int] = ..., tokens_total: _Optional[int] = ..., tokens_committed: _Optional[int] = ..., outer_step: _Optional[int] = ..., nodes_active: _Optional[int] = ...) -> None: ...

class RunList(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunInfo]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunInfo, _Mapping]]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunRef(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class SetRunStateRequest(_message.Message):
    __slots__ = ("run_id", "state")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("run_id", "ttl_s", "uses", "note")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    ttl_s: float
    uses: int
    note: str
    def __init__(self, run_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., uses: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class TokenInfo(_message.Message):
    __slots__ = ("token_id", "run_id", "created_at", "expires_at", "uses_left", "max_uses", "revoked", "note")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    USES_LEFT_FIELD_NUMBER: _ClassVar[int]
    MAX_USES_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    run_id: str
    created_at: float
    expires_at: float
    uses_left: int
    max_uses: int
    revoked: bool
    note: str
    def __init__(self, token_id: _Optional[str] = ..., run_id: _Optional[str] = ..., created_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., uses_left: _Optional[int] = ..., max_uses: _Optional[int] = ..., revoked: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class CreateTokenReply(_message.Message):
    __slots__ = ("info", "token")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    info: TokenInfo
    token: str
    def __init__(self, info: _Optional[_Union[TokenInfo, _Mapping]] = ..., token: _Optional[str] = ...) -> None: ...

class ListTokensRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TokenList(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenInfo, _Mapping]]] = ...) -> None: ...

class RevokeTokenRequest(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    def __init__(self, token_id: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "run_id", "status", "joined_at", "last_heartbeat", "hardware", "tokens_per_s", "peer_address", "certificate_pem", "tokens_committed", "bytes_sent", "shards_held", "ban_reason", "updates_rejected", "reachability", "name")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_HELD_FIELD_NUMBER: _ClassVar[int]
    BAN_REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    status: str
    joined_at: float
    last_heartbeat: float
    hardware: Hardware
    tokens_per_s: float
    peer_address: str
    certificate_pem: str
    tokens_committed: int
    bytes_sent: int
    shards_held: _containers.RepeatedScalarFieldContainer[int]
    ban_reason: str
    updates_rejected: int
    reachability: str
    name: str
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., status: _Optional[str] = ..., joined_at: _Optional[float] = ..., last_heartbeat: _Optional[float] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., tokens_per_s: _Optional[float] = ..., peer_address: _Optional[str] = ..., certificate_pem: _Optional[str] = ..., tokens_committed: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., shards_held: _Optional[_Iterable[int]] = ..., ban_reason: _Optional[str] = ..., updates_rejected: _Optional[int] = ..., reachability: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("run_id", "status")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    status: str
    def __init__(self, run_id: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class NodeRef(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class BanRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_id", "name", "tokens", "committed_offset", "holder", "lease_expires_at", "done")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    name: str
    tokens: int
    committed_offset: int
    holder: str
    lease_expires_at: float
    done: bool
    def __init__(self, shard_id: _Optional[int] = ..., name: _Optional[str] = ..., tokens: _Optional[int] = ..., committed_offset: _Optional[int] = ..., holder: _Optional[str] = ..., lease_expires_at: _Optional[float] = ..., done: _Optional[bool] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ShardList(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "at", "run_id", "kind", "node_id", "detail")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: float
    run_id: str
    kind: str
    node_id: str
    detail: str
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[float] = ..., run_id: _Optional[str] = ..., kind: _Optional[str] = ..., node_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("run_id", "after_seq", "limit", "kind")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_seq: int
    limit: int
    kind: str
    def __init__(self, run_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., limit: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class EventList(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ReadStateRequest(_message.Message):
    __slots__ = ("run_id", "csr_pem")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    csr_pem: bytes
    def __init__(self, run_id: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class ReadStateGrant(_message.Message):
    __slots__ = ("run_id", "certificate_pem", "ca_certificate_pem", "config_toml", "round", "state_hash", "holders", "tokens_committed", "stages", "kept")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    certificate_pem: bytes
    ca_certificate_pem: bytes
    config_toml: str
    round: int
    state_hash: str
    holders: _containers.RepeatedCompositeFieldContainer[LiveMember]
    tokens_committed: int
    stages: _containers.RepeatedCompositeFieldContainer[StageState]
    kept: bool
    def __init__(self, run_id: _Optional[str] = ..., certificate_pem: _Optional[bytes] = ..., ca_certificate_pem: _Optional[bytes] = ..., config_toml: _Optional[str] = ..., round: _Optional[int] = ..., state_hash: _Optional[str] = ..., holders: _Optional[_Iterable[_Union[LiveMember, _Mapping]]] = ..., tokens_committed: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageState, _Mapping]]] = ..., kept: _Optional[bool] = ...) -> None: ...

class StageState(_message.Message):
    __slots__ = ("stage", "name", "state_hash", "holders")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    name: str
    state_hash: str
    holders: _containers.RepeatedCompositeFieldContainer[LiveMember]
    def __init__(self, stage: _Optional[int] = ..., name: _Optional[str] = ..., state_hash: _Optional[str] = ..., holders: _Optional[_Iterable[_Union[LiveMember, _Mapping]]] = ...) -> None: ...

class RecoverRunRequest(_message.Message):
    __slots__ = ("run_id", "start_from")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    START_FROM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    start_from: str
    def __init__(self, run_id: _Optional[str] = ..., start_from: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run", "nodes", "last_loss", "tokens_per_s", "bytes_sent", "rounds", "nodes_by_status", "last_round_at", "last_round_age_s", "stall_after_s", "stalled", "stall_reason", "stopped", "kept", "waiting_for_operator")
    class NodesByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NODES_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALL_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    STALL_REASON_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_OPERATOR_FIELD_NUMBER: _ClassVar[int]
    run: RunInfo
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    last_loss: float
    tokens_per_s: float
    bytes_sent: int
    rounds: int
    nodes_by_status: _containers.ScalarMap[str, int]
    last_round_at: float
    last_round_age_s: float
    stall_after_s: float
    stalled: bool
    stall_reason: str
    stopped: bool
    kept: KeptState
    waiting_for_operator: str
    def __init__(self, run: _Optional[_Union[RunInfo, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., last_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., rounds: _Optional[int] = ..., nodes_by_status: _Optional[_Mapping[str, int]] = ..., last_round_at: _Optional[float] = ..., last_round_age_s: _Optional[float] = ..., stall_after_s: _Optional[float] = ..., stalled: _Optional[bool] = ..., stall_reason: _Optional[str] = ..., stopped: _Optional[bool] = ..., kept: _Optional[_Union[KeptState, _Mapping]] = ..., waiting_for_operator: _Optional[str] = ...) -> None: ...

class GetStagesRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StagePeerInfo(_message.Message):
    __slots__ = ("node_id", "report", "assigned_stage", "assignment", "last_heartbeat")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_STAGE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    report: StageReport
    assigned_stage: int
    assignment: str
    last_heartbeat: float
    def __init__(self, node_id: _Optional[str] = ..., report: _Optional[_Union[StageReport, _Mapping]] = ..., assigned_stage: _Optional[int] = ..., assignment: _Optional[str] = ..., last_heartbeat: _Optional[float] = ...) -> None: ...

class StageSummary(_message.Message):
    __slots__ = ("stage", "first_block", "end_block", "peers", "samples_per_s", "queue", "last_move", "last_move_at")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    LAST_MOVE_FIELD_NUMBER: _ClassVar[int]
    LAST_MOVE_AT_FIELD_NUMBER: _ClassVar[int]
    stage: int
    first_block: int
    end_block: int
    peers: int
    samples_per_s: float
    queue: int
    last_move: str
    last_move_at: float
    def __init__(self, stage: _Optional[int] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., peers: _Optional[int] = ..., samples_per_s: _Optional[float] = ..., queue: _Optional[int] = ..., last_move: _Optional[str] = ..., last_move_at: _Optional[float] = ...) -> None: ...

class StageMap(_message.Message):
    __slots__ = ("run_id", "stages", "peers", "summary", "pending_move", "rebalance_every_s", "tokens_committed", "kept")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    PENDING_MOVE_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stages: int
    peers: _containers.RepeatedCompositeFieldContainer[StagePeerInfo]
    summary: _containers.RepeatedCompositeFieldContainer[StageSummary]
    pending_move: str
    rebalance_every_s: float
    tokens_committed: int
    kept: KeptState
    def __init__(self, run_id: _Optional[str] = ..., stages: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[StagePeerInfo, _Mapping]]] = ..., summary: _Optional[_Iterable[_Union[StageSummary, _Mapping]]] = ..., pending_move: _Optional[str] = ..., rebalance_every_s: _Optional[float] = ..., tokens_committed: _Optional[int] = ..., kept: _Optional[_Union[KeptState, _Mapping]] = ...) -> None: ...
