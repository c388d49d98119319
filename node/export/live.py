"""A live run's newest state, read into a `Source` (`murmur export --coordinator ADDR`).

The operator's admin credential buys a reader's pass (the coordinator's ReadState call): a
certificate for a key made here, signed by the run's CA, and the live nodes that hold the run's
newest round under the hash most of them announce. The state is then fetched from those nodes the
way a joiner fetches it (node/net/state_transfer.py: GetState, every tensor checked, the whole
checked against the hash) and never touches the run: the reader holds no lease and commits nothing.
"""

from __future__ import annotations

import time
from typing import Any

from murmur.node.export.source import Source, SourceError

READ_ATTEMPTS = 5
RETRY_BASE_S = 1.0  # the back-off after a failed fetch: 1, 2, 4, 5 s (12 s in all, past a heartbeat TTL)
RETRY_MAX_S = 5.0


def read_live(target: Any, run_id: str = "", *, timeout_s: float = 600.0) -> Source:
    """The newest state of ``run_id`` (the only active run if empty) through the coordinator at
    ``target`` (protocol/admin_client.py's AdminTarget)."""
    import asyncio

    from murmur.node.daemon.shared_state import GLOBAL_PREFIXES
    from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch, state_name
    from murmur.node.train.build import resolve_model_config
    from murmur.protocol import coordinator_pb2 as pb
    from murmur.protocol.admin_client import AdminClient
    from murmur.protocol.identity import Identity, generate_key, make_csr
    from murmur.protocol.runconfig import parse_config
    from murmur.protocol.wire import tensors_hash

    key = generate_key()
    errors = []
    # A holder keeps only its last few rounds' states, and a small run trains several rounds a
    # second: a round named by the coordinator can be gone before the fetch asks for it. Ask the
    # coordinator again for the newest one then.
    for _ in range(READ_ATTEMPTS):
        with AdminClient(target) as client:
            grant = client.call("ReadState", pb.ReadStateRequest(run_id=run_id, csr_pem=make_csr(key)))
        reader = Identity(key=key, cert_pem=grant.certificate_pem, ca_cert_pem=grant.ca_certificate_pem)
        if grant.stages:  # a pipelined run: each stage's state, from its peers or the kept set
            try:
                return _stages_source(target, grant, reader, timeout_s)
            except (StateError, TimeoutError) as err:
                errors.append(f"the stages' states: {err or 'timed out'}")
                continue
        holders = {m.node_id: m.peer_address for m in grant.holders}
        want = bytes.fromhex(grant.state_hash)
        # The coordinator's kept copy, when no live node serves the run (coordinator/keeper.py).
        name = f"kept/{grant.run_id}/{state_name(grant.round)}" if grant.kept else state_name(grant.round)
        try:
            tensors, _ = asyncio.run(
                asyncio.wait_for(afetch(reader, holders, name, want, settings=StateFetchSettings()), timeout_s)
            )
            break
        except (StateError, TimeoutError) as err:
            errors.append(f"round {grant.round} from {len(holders)} holder(s): {err or 'timed out'}")
            # A holder that died a moment ago is live to the coordinator until its heartbeat TTL
            # passes; asking again at once would name it again. Back off, so the next grant names
            # the holders still alive, or the coordinator's kept copy once none is.
            if len(errors) < READ_ATTEMPTS:
                time.sleep(min(RETRY_BASE_S * 2 ** (len(errors) - 1), RETRY_MAX_S))
    else:
        raise SourceError(f"could not fetch run {grant.run_id}'s newest state: {'; '.join(errors)}")
    cfg = parse_config(grant.config_toml, f"run {grant.run_id}")
    # The model's parameters: `param/<name>`, or `global/<name>` for Streaming DiLoCo's fragments.
    model_part = [(n, t) for n, t in tensors.items() if n.startswith(GLOBAL_PREFIXES)]
    weights = {n.split("/", 1)[1]: t for n, t in model_part}
    if "embed.weight" not in weights:
        raise SourceError(f"run {grant.run_id}'s state holds no model weights murmur knows (no embed.weight)")
    model = resolve_model_config(cfg, int(weights["embed.weight"].shape[0]))
    provenance = {
        "source": f"coordinator {target.address}",
        "run_name": cfg.name,
        "run_id": grant.run_id,
        "round": int(grant.round),
        # The model's hash, as each node's round log records it; and that of the whole shared state
        # (with the outer optimizer's momentum and the counters) that the nodes announce and the
        # fetch was checked against:
        "state_hash": tensors_hash(model_part).hex(),
        "shared_state_hash": grant.state_hash,
        "tokens_trained": int(grant.tokens_committed),
        "tokens_note": "the run's committed tokens when the coordinator granted the read",
        "holders": sorted(holders),
        "kept": bool(grant.kept),  # from the coordinator's kept copy: no live node served the run
    }
    return Source(
        path=f"run {grant.run_id} via {target.address}",
        kind="live run",
        model=model,
        weights=weights,
        tokenizer=cfg.data.tokenizer,
        run_config=cfg.to_dict(),
        provenance=provenance,
    )


def _stages_source(target: Any, grant: Any, reader: Any, timeout_s: float) -> Source:
    """A pipelined run's model from each stage's state (docs/export.md): a live stage peer's
    published state (it changes after every optimizer step, so it is checked against the hash it
    is served under, and a read that straddles a step is read again), or the coordinator's kept
    set (checked against the hashes it kept)."""
    import asyncio

    from murmur.node.export.stage_set import model_order
    from murmur.node.net.state_transfer import afetch
    from murmur.node.pipeline.config import model_from_run
    from murmur.protocol.runconfig import parse_config
    from murmur.protocol.wire import tensors_hash

    async def fetch_all() -> tuple[dict, list[dict]]:
        weights, rows = {}, []
        for st in grant.stages:
            holders = {m.node_id: m.peer_address for m in st.holders}
            want = bytes.fromhex(st.state_hash) if grant.kept else None
            tensors, _ = await afetch(reader, holders, st.name, want)
            weights.update(tensors)
            rows.append({"stage": st.stage, "state_hash": tensors_hash(tensors.items()).hex(),
                         "holders": sorted(holders)})
        return weights, rows

    weights, rows = asyncio.run(asyncio.wait_for(fetch_all(), timeout_s))
    cfg = parse_config(grant.config_toml, f"run {grant.run_id}")
    model, _ = model_from_run(cfg)
    order = model_order(model)
    missing = [n for n in order if n not in weights]
    if missing:
        raise SourceError(f"run {grant.run_id}'s stages do not hold {missing[:3]}: another layer split?")
    weights = {n: weights[n] for n in order}
    provenance = {
        "source": f"coordinator {target.address}",
        "run_name": cfg.name,
        "run_id": grant.run_id,
        "round": int(grant.round),
        "inner_steps": None,
        "state_hash": tensors_hash(weights.items()).hex(),
        "stages": rows,
        "tokens_trained": int(grant.tokens_committed),
        "tokens_note": "the run's committed tokens when the coordinator granted the read",
        "kept": bool(grant.kept),
    }
    return Source(
        path=f"run {grant.run_id} via {target.address}", kind="live pipeline", model=model, weights=weights,
        tokenizer=cfg.data.tokenizer, run_config=cfg.to_dict(), provenance=provenance,
    )
