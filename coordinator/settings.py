"""Every timeout and limit of the coordinator, named, with its default and why.

How to choose them (docs/coordinator.md has the long version):
* heartbeat_interval_s: how often nodes report. 1 s is cheap (a thousand nodes are a thousand
  small writes per second) and lets a lost node be noticed within seconds.
* heartbeat_ttl_s: a node that has not reported for this long is marked lost. Several intervals,
  so one delayed packet or a GC pause does not evict a node.
* lease_ttl_s: a lease not renewed (heartbeats renew every lease a node holds) for this long
  expires and the shard goes back to the pool from its last committed offset. It is the upper
  bound on how long a vanished node's shard sits idle.
* gone_dial_every_s: a trainer a member reports dead (its address refused a connect: ReportGone)
  is dialed by the coordinator at most this often, whoever reports it; a refused dial loses it at
  once instead of after heartbeat_ttl_s (coordinator/gone.py). It bounds the connects reports can
  cause (one per live trainer per period), and how soon a peer whose dial was accepted (alive,
  or its port taken over) can be dialed again.
* join_grace_s: a node that just joined, or whose restarted process said it is starting (the
  ``starting`` heartbeat), has this long for its next heartbeat, then heartbeat_ttl_s as usual:
  it starts its peer server and DHT before it heartbeats (hivemind forks the DHT's process, which
  must not happen under live gRPC calls), 6 s on the testnet's loopback and tens of seconds for
  a DHT that bootstraps over the internet. With the TTL alone, every testnet node (TTL 3 s) was
  marked lost 3 s after it joined, and again at each restart. A starting node is no trainer (it
  reports no peer address yet), so the grace delays no round; a restarted one that dies while
  starting keeps its previous process's lease until the grace ends (a shard idle that much
  longer).
* stall_after_s: a run whose active nodes complete no round for this long (or for 3 of its recent
  rounds' median gap, if longer: a run of slow rounds is not stalled after one) shows as stalled
  in `murmur admin status`, on the status page and in the metrics. 180 s is over the node's
  round_timeout_s (120 s), after which a round that could not complete has failed at every node.
* call_wait_s: a call that arrived may wait this long for the coordinator's loop to take it
  before gRPC cancels it (its core's default is 30 s). A saturated loop takes new calls slowly: at
  10,000 nodes the heartbeat streams opening together waited past 30 s and were CANCELLED in
  thousands. Clients bound their own waits, so an hour only stops the server giving up first.
* heartbeat_fronts: processes beside the coordinator's own that carry the nodes' heartbeat
  streams (coordinator/fronts.py), each node's on one of them by its node id. One Python process
  spends some 130 us of its loop thread on gRPC's own work for each streamed heartbeat, so it tops
  out near 8,000 a second; the fronts take that work off it, and it answers their beats in batches
  (some tens of us each). 0 (the default): every stream at the node address, as before. Give it
  about one per 4,000 nodes at 1 Hz, no more than the cores the coordinator has.
* heartbeat_udp: where nodes may send their heartbeats as signed UDP datagrams
  (coordinator/heartbeat_udp.py, protocol/heartbeat_datagram.py): a datagram costs the
  coordinator tens of microseconds where a streamed heartbeat costs 150-250, which is what lets
  10,000 nodes at 1 Hz fit two cores. "node-port" (the default): UDP on the node address's host
  and port number (one number to open in a firewall, TCP and UDP; a free port when the node port
  is 0); a port number (0: a free one); "off": heartbeats over gRPC only. A node whose datagrams
  go unanswered falls back to gRPC on its own, so a firewall that drops UDP costs nothing.
* restart_grace_s: after the coordinator restarts, no node is declared lost and no lease expires
  for this long, counted from the moment it serves again (nobody could renew while it was down,
  and nodes need a moment to reconnect).
"""

from __future__ import annotations

from dataclasses import dataclass

from murmur.errors import MurmurError
from murmur.protocol.coordinator_names import (  # noqa: F401 - the coordinator's modules import them from here
    ADMIN_CALL_TIMEOUT_S,
    ADMIN_METADATA_KEY,
    TLS_SERVER_NAME,
)

MAX_FRONTS = 64  # heartbeat front processes: far past any host's use (one per core at most)


class SettingsError(MurmurError):
    pass


@dataclass(kw_only=True, slots=True)
class CoordinatorSettings:
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 10.0
    lease_ttl_s: float = 30.0
    sweep_interval_s: float = 0.5  # how often lost nodes and expired leases are looked for
    heartbeat_flush_s: float = 5.0  # how often heartbeats (kept in memory) are written to the ledger
    join_grace_s: float = 60.0
    restart_grace_s: float = 30.0
    gone_dial_every_s: float = 1.0  # the coordinator's verifying dials of one reported peer, at most this often
    token_ttl_s: float = 24 * 3600.0  # default lifetime of a join token
    token_uses: int = 1  # default number of nodes one token admits
    max_message_bytes: int = 4 * 1024 * 1024  # configs and manifests are small; refuse anything bigger
    max_config_bytes: int = 256 * 1024
    max_shards: int = 1_000_000
    tokens_per_s_window_s: float = 60.0  # the window `status` averages throughput over
    grpc_grace_s: float = 2.0  # in-flight calls get this long on shutdown
    dht_start_timeout_s: float = 30.0
    wal_checkpoint_pages: int = 1000  # SQLite's automatic WAL checkpoint threshold (0: never automatic)
    stall_after_s: float = 180.0  # no round completed this long while nodes are active: stalled
    call_wait_s: float = 3600.0  # a call may wait this long for the loop to take it (serving.serving_options)
    heartbeat_fronts: int = 0  # heartbeat front processes (coordinator/fronts.py); 0: none
    heartbeat_udp: str = "node-port"  # heartbeat datagrams: "node-port", a port number (0 free) or "off"

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_interval_s",
            "heartbeat_ttl_s",
            "lease_ttl_s",
            "sweep_interval_s",
            "token_ttl_s",
            "tokens_per_s_window_s",
            "gone_dial_every_s",
            "join_grace_s",
            "stall_after_s",
            "call_wait_s",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive, got {getattr(self, name)}")
        # Twice the interval at least: a heartbeat arrives an interval after the last one plus its
        # own latency, so a TTL of one interval expires between two on-time heartbeats now and
        # then (a lease of 1 s under 1 s heartbeats did, and its node's commits were refused).
        if self.heartbeat_ttl_s < 2 * self.heartbeat_interval_s:
            raise SettingsError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must be at least twice heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or a node is lost whenever one heartbeat is late"
            )
        if self.lease_ttl_s < 2 * self.heartbeat_interval_s:
            raise SettingsError(
                f"lease_ttl_s ({self.lease_ttl_s}) must be at least twice heartbeat_interval_s "
                f"({self.heartbeat_interval_s}): heartbeats renew leases, and one may be late"
            )
        if not 0 <= self.heartbeat_fronts <= MAX_FRONTS:
            raise SettingsError(
                f"heartbeat_fronts must be 0 to {MAX_FRONTS}, got {self.heartbeat_fronts}: about one per "
                "4,000 nodes, no more than the coordinator's cores"
            )
        if self.heartbeat_udp not in ("node-port", "off") and not (
            self.heartbeat_udp.isdigit() and 0 <= int(self.heartbeat_udp) < 65536
        ):
            raise SettingsError(
                f"heartbeat_udp must be node-port, off or a UDP port number (0 picks a free one), got "
                f"{self.heartbeat_udp!r}"
            )
        if self.token_uses < 1:
            raise SettingsError("token_uses must be at least 1")

    def heartbeat_udp_port(self, node_port: int) -> int | None:
        """The UDP port to bind for heartbeat datagrams (0: a free one); None: off."""
        if self.heartbeat_udp == "off":
            return None
        return node_port if self.heartbeat_udp == "node-port" else int(self.heartbeat_udp)
