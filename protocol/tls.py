"""Mutual TLS for every peer connection, and who is on the other end of one.

Both sides present a certificate of the run's CA (ECDSA P-256: gRPC's TLS fails on Ed25519)
and accept only the run's CA. A client dials a peer by the node id the DHT named and sets
``grpc.ssl_target_name_override`` to that id, which the peer's certificate carries as its DNS
SAN: a peer is verified as exactly the node it claims to be, whatever its IP address.

The ban list: gRPC Python cannot hook into the TLS handshake itself, and a grpc.aio server
interceptor does not see the peer's certificate. So the server runs ``authenticated_peer`` as the
first thing of every handler (node/net/server.py wraps each one): it reads the verified
certificate from ``context.auth_context()``, derives the node id and refuses a banned id with
PERMISSION_DENIED naming the reason, before any payload is read. Clients refuse to dial a banned
id at all (``check_dial``). A certificate from another CA never gets that far: the TLS handshake
fails, so the stranger's call ends UNAVAILABLE and the server never sees a request.
"""

from __future__ import annotations

import functools

import grpc

from murmur.protocol.identity import BanList, Identity, IdentityError, node_id_of_certificate

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # one gRPC message; payloads travel in frames below this


def server_credentials(identity: Identity) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.cert_pem)],
        root_certificates=identity.ca_cert_pem,
        require_client_auth=True,
    )


def channel_credentials(identity: Identity) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=identity.ca_cert_pem,
        private_key=identity.key_pem,
        certificate_chain=identity.cert_pem,
    )


def message_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """A server's options. gRPC binds its servers with SO_REUSEPORT by default, so a coordinator
    restarted on its address while another process holds that port bound it too, and the kernel
    split the nodes' connections between the two: heartbeats landed on a stranger's server. Without
    it the bind fails, and the server says so."""
    return [*message_options(max_message_bytes), ("grpc.so_reuseport", 0)]


def channel_options(peer_node_id: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list:
    return [("grpc.ssl_target_name_override", peer_node_id), *message_options(max_message_bytes)]


def check_dial(peer_node_id: str, ban_list: BanList | None) -> None:
    """Refuse to connect to a banned node (raises BannedError)."""
    if ban_list is not None:
        ban_list.check(peer_node_id)


def secure_channel(
    identity: Identity,
    address: str,
    peer_node_id: str,
    *,
    ban_list: BanList | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.aio.Channel:
    check_dial(peer_node_id, ban_list)
    return grpc.aio.secure_channel(
        address, channel_credentials(identity), options=channel_options(peer_node_id, max_message_bytes)
    )


def authenticated_peer(auth_context: dict[str, list[bytes]], ban_list: BanList | None = None) -> str:
    """The node id of the TLS-verified client behind a call; IdentityError/BannedError otherwise."""
    pem = auth_context.get("x509_pem_cert")
    if not pem:
        raise IdentityError("the connection carries no client certificate (mutual TLS is required)")
    node_id = _node_id_of_pem(pem[0])
    if ban_list is not None:
        ban_list.check(node_id)
    return node_id


# A certificate verified by the handshake names the same node at every call on its connection:
# parsed once, not at every call (a pipeline's stage peer answers several calls per microbatch).
# A certificate that names no node raises each time (lru_cache keeps no exception).
@functools.lru_cache(maxsize=1024)
def _node_id_of_pem(pem: bytes) -> str:
    return node_id_of_certificate(pem)
