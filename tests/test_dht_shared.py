"""MurmurDHT.signing_as: several peers of one process share one DHT process (benchmarks/scale.py),
each record still signed by its own peer's key; the shared handle's shutdown leaves the DHT up."""

import pytest
from _net_helpers import p2pd_processes

from murmur.protocol import dht as D
from murmur.protocol.identity import CertificateAuthority

pytestmark = pytest.mark.integration


def test_peers_sharing_a_dht_announce_as_themselves_and_only_the_owner_stops_it():
    ca = CertificateAuthority.create("dht-shared")
    a, b = ca.issue(), ca.issue()
    with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=a) as da:
        db = da.signing_as(b)
        assert db.helper_pids == da.helper_pids  # no second DHT process
        assert db.announce(D.PeerRecord(node_id=b.node_id, address="127.0.0.1:2"))
        assert da.announce(D.PeerRecord(node_id=a.node_id, address="127.0.0.1:1"))
        with pytest.raises(D.DHTError, match="only announce its own"):
            db.announce(D.PeerRecord(node_id=a.node_id, address="evil"))
        assert {p.node_id: p.address for p in da.peers()} == {a.node_id: "127.0.0.1:1", b.node_id: "127.0.0.1:2"}
        helpers = da.helper_pids
        db.shutdown()
        assert [p.node_id for p in da.peers()] == sorted([a.node_id, b.node_id])  # still serving
    assert not any(p.pid in helpers for p in p2pd_processes())
