"""Every timeout and limit of the volunteer node, named, with its default and why.

docs/failure-model.md explains how to choose each one. The coordinator tells a node how often to
heartbeat and how long its leases live (JoinReply); everything else is the node's own choice.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from murmur.errors import MurmurError


class NodeSettingsError(MurmurError):
    pass


@dataclass(kw_only=True, slots=True)
class NodeSettings:
    # Control plane (coordinator).
    join_timeout_s: float = 30.0  # one Join call: TLS handshake, CSR signing, config download
    rpc_timeout_s: float = 10.0  # any other coordinator call; a slower reply counts as an outage
    outage_retry_s: float = 1.0  # wait between attempts while the coordinator is unreachable
    lease_wait_s: float = 2.0  # wait before asking again when no shard is free
    max_pending_commits: int = 10_000  # commits queued through an outage (kept on disk too)
    # Data plane (peers).
    round_timeout_s: float = 120.0  # the longest wait for one exchange round's result
    peer_timeout_s: float = 30.0  # a round member silent this long is dropped from the round
    rendezvous_deadline_s: float = 15.0  # how long a round's rendezvous waits for announced peers
    dht_record_ttl_s: float = 20.0  # this node's DHT record lives this long unless re-announced
    peers_wait_s: float = 60.0  # at start, how long to wait for --min-peers peers to show up
    state_fetch_timeout_s: float = 60.0  # fetching the global state from peers on (re)join
    dht_start_timeout_s: float = 30.0  # starting the DHT and reaching a bootstrap peer
    # Lifecycle.
    shutdown_grace_s: float = 10.0  # after SIGTERM: time for the last commit, release and leave
    checkpoint_every_rounds: int = 1  # local checkpoint period in outer rounds (0: only on exit)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "checkpoint_every_rounds":
                if value < 0:
                    raise NodeSettingsError(f"{f.name} must not be negative, got {value}")
            elif value <= 0:
                raise NodeSettingsError(f"{f.name} must be positive, got {value}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
