"""A node restarted behind the run while every holder of the run's newer state is dead.

Seen in a chaos round at a 5 s MTBF: node C was killed after round r; A and B completed more
rounds; then A and B were killed too. C restarted from its checkpoint (round r), could fetch the
newer state from nobody, and trained round r + 1 alone from its own state; when a node holding the
run's round r + 1 came back, the two trained together from two different states, and every round
they completed had two hashes. Now:

* C's heartbeat replies say the run reached a newer round even when no trainer is live (the view
  is whole, the list empty): C waits for that state instead of training (``state_fetch_timeout_s``);
* past that wait the rounds after its own are lost with their holders: C goes on from its state
  numbered as the run's newest round, so no round number ever has two states;
* A, back with the older run state, takes C's (the run's newest) and they train on together.

Whatever C's group trains, the coordinator grants only rounds no other group completed (ClaimRound).
Real processes, real SIGKILLs; no timing assertions (the waits are for log lines and rounds)."""

from __future__ import annotations

import re
import signal
import time

import pytest
from _node_helpers import churn_net, ledger, log, small_dataset, trained, wait_log, wait_rounds

from murmur.node.testnet.chaos import analyze
from murmur.node.testnet.procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WAIT_S = 240.0  # rounds of three tiny nodes on a loaded 2-core machine


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("restart-data"))


def train_on_together(net, a, c, past: int) -> None:
    """Wait for a and c to complete a round past ``past`` together (a round count alone is not it:
    a node going on renumbered jumps past it), stop both, and check every round has one hash."""

    def together() -> bool:
        return all(any(int(r["round"]) > past and r["peers"] == 2 for r in trained(n)) for n in (a, c))

    wait_for(together, WAIT_S, what="a and c to train on together")
    for node in (a, c):
        node.proc.send_signal(signal.SIGTERM)
    for node in (a, c):
        assert node.proc.wait(60) == 0, log(node)[-3000:]
    stats = analyze(net, 0.0, 0.0)
    assert stats["hash_agreement"] and stats["split_brain_rounds"] == 0, stats


def last_round(node) -> int:
    return max((int(r["round"]) for r in trained(node)), default=0)


def test_a_restart_behind_the_run_with_its_holders_dead_never_trains_apart(tmp_path, data):
    with churn_net(tmp_path, data, token_uses=12) as net:
        a, b, c = (net.add_node(extra=["--min-peers", "3"]) for _ in range(3))
        for node in (a, b, c):
            wait_rounds(node, 2, timeout_s=WAIT_S)
        net.kill_node(c)
        behind = last_round(c)
        wait_for(lambda: min(last_round(a), last_round(b)) >= behind + 3, WAIT_S, what="a and b to go on without c")
        # The holders die one after the other, A a few ms before B. B may complete a round with A's
        # input after A died and die before a heartbeat says so; A, back from the checkpoint before
        # that round, is another process than the one in B's group (a grant names incarnations),
        # so a group of A and C is refused that round, and the grant made it the run's newest
        # round: they wait for it, then go on numbered past it (two hashes for one round before).
        net.kill_node(a)
        net.kill_node(b)
        run_at = max(last_round(a), last_round(b))
        # C comes back behind the run with nobody to take the run's state from. The coordinator
        # heard of the run's newest round (a heartbeat, or a grant of a round A and B completed
        # after their last heartbeat): C waits for it, gives up after 5 s and goes on numbered past
        # it. A group of C and anyone is refused the rounds granted to A and B (ClaimRound).
        since = len(log(c))
        net.start_node(c, extra=["--state-fetch-timeout", "5"])
        either = r"going on from this node's round \d+ as round \d+|refused this group's round"
        wait_log(c, either, timeout_s=WAIT_S, since=since)
        net.start_node(a)
        mark = max(last_round(a), last_round(c))

        train_on_together(net, a, c, past=mark)
        assert not [r for r in trained(c) if behind < int(r["round"]) <= run_at], "c trained rounds the run had done"
        for node in (a, c):  # together again
            assert [r for r in trained(node) if int(r["round"]) > mark and r["peers"] == 2], trained(node)[-4:]
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total



def test_a_round_granted_to_a_group_that_died_before_saying_so_is_numbered_past(tmp_path, data):
    """A and B complete round R (the coordinator granted it to them) and die before recording it:
    both are held before R's checkpoint, and SIGKILLed there (R's state is published, and
    heartbeated, once hashed: its holders died with it all the same). C comes back behind the
    run. The grant made R the run's newest round, so C waits for it and then goes on numbered R
    (or past), not R - 1: as R - 1 its next round would be R, which the coordinator refuses to any
    group but A and B's. A, back from its checkpoint of R - 1, is behind C and takes C's state
    (granted by node ids, a group of A and C could complete R again, from C's state and A's: two
    states). They train on with one hash."""
    with churn_net(tmp_path, data, token_uses=12) as net:
        a, c = (net.add_node(extra=["--min-peers", "2"]) for _ in range(2))
        for node in (a, c):
            wait_rounds(node, 2, timeout_s=WAIT_S)
        net.kill_node(c)
        a.proc.send_signal(signal.SIGTERM)  # to restart it with the hold armed, a few rounds ahead
        assert a.proc.wait(60) == 0, log(a)[-3000:]
        # B must not count C as its second peer: within C's heartbeat TTL the coordinator still lists
        # it, and B (started in that window on a loaded CI machine) took its --min-peers as met,
        # trained alone past round R before A was back, and A then took B's state past R: A's hold
        # never struck. Wait for the coordinator to see C gone.
        c_id = wait_log(c, r"joined run \S+ as (\S+)").group(1)
        wait_for(lambda: {n["node_id"]: n["status"] for n in net.admin("nodes", "list", "--run", net.run_id)["nodes"]}
                 .get(c_id) != "active", WAIT_S, what="the coordinator to see c gone")
        held = last_round(a) + 3
        hold = ["--min-peers", "2", "--fault", f"delay:checkpoint:600@{held}"]
        since_a = len(log(a))
        # B first, in the DHT before A is back: started together, A counted C's expired record
        # as its second peer, trained alone past round R before B came (its state of R - 1 then
        # stuck behind the held checkpoint; B took it and looped on a dropped result: see
        # test_churn_catchup.py), and B never reached R. Now A waits for B (a newcomer counts).
        b = net.add_node(extra=hold)
        wait_log(b, r"peer server on", WAIT_S)
        net.start_node(a, extra=hold)
        for node, since in ((a, since_a), (b, 0)):
            wait_log(node, rf"injected fault: checkpoint delayed 600.0 s \(round {held}\)", WAIT_S, since)
        assert max(last_round(a), last_round(b)) == held - 1  # nobody recorded round `held`
        net.kill_node(a)
        net.kill_node(b)
        since_c = len(log(c))
        net.start_node(c, extra=["--state-fetch-timeout", "5"])
        # (C's round: its checkpoint's, which may be one past its last record: the kill can land
        # between a round's checkpoint and its record.)
        behind = int(wait_log(c, r"resumed from the local checkpoint at round (\d+)", WAIT_S, since_c).group(1))
        went_on = wait_log(c, r"going on from this node's round (\d+) as round (\d+)", timeout_s=WAIT_S, since=since_c)
        # Checkpoints are written beside the training thread (node/daemon/round_finish.py): held at
        # R's, A and B may have completed and been granted a round or two more before the kill.
        numbered = int(went_on.group(2))
        # (From its checkpoint's round, or from the coordinator's kept state if that is newer.)
        assert int(went_on.group(1)) >= behind and numbered >= held, went_on.group(0)
        net.start_node(a)
        train_on_together(net, a, c, past=numbered)
        assert not [r for n in (a, b, c) for r in trained(n) if held <= int(r["round"]) <= numbered], "R was recorded"
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total


def test_a_live_node_refused_a_round_whose_holders_died_goes_on_past_it(tmp_path, data):
    """The same loss, seen by a node that stays up: C is held at round R's rendezvous, A and
    B complete R without it and die before they publish it. C, alone now, trains R, and the
    coordinator refuses it: A and B's group has it. Every retry is refused the same way, so once
    nobody has served the run's newer state for state_fetch_timeout_s C goes on numbered R
    (round R is lost with A and B) and trains R + 1, which it is granted."""
    held = 6
    with churn_net(tmp_path, data, token_uses=6) as net:
        # A and B wait for C before their first round: with --min-peers 2 they met each other and
        # trained to R before C, slower to start on a loaded machine, was in; C then joined behind
        # them, they were killed meanwhile, and C went on alone: never held, never refused.
        hold = ["--min-peers", "3", "--fault", f"delay:checkpoint:600@{held}"]
        a, b = (net.add_node(extra=hold) for _ in range(2))
        # The exchange numbers a DiLoCo round's call from 0: round R is call R - 1.
        # The hold must outlast A and B's round R (their wait for C at the rendezvous, 8 s, and the
        # exchange): 20 s did not on a machine at load 16, and C met them in R after all. So it
        # lasts until the test lets it go (SIGUSR1), once A and B are dead.
        c = net.add_node(extra=["--min-peers", "2", "--state-fetch-timeout", "5",
                                "--fault", f"delay:rendezvous:600@{held - 1}"])
        for node in (a, b):
            wait_log(node, rf"injected fault: checkpoint delayed 600.0 s \(round {held}\)", WAIT_S)
        net.kill_node(a)
        net.kill_node(b)
        wait_log(c, rf"injected fault: rendezvous delayed 600.0 s \(round {held - 1}\)", WAIT_S)
        c.proc.send_signal(signal.SIGUSR1)
        wait_log(c, rf"the coordinator refused this group's round {held - 1}", timeout_s=WAIT_S)
        # (A and B may have completed and been granted a round or two past R: their checkpoints are
        # written beside their training threads.)
        went_on = wait_log(c, rf"the run got to round (\d+) but nobody serves rounds? {held}\b", timeout_s=WAIT_S)
        numbered = int(went_on.group(1))
        assert numbered >= held, went_on.group(0)
        wait_for(lambda: last_round(c) > numbered, WAIT_S, what="c's next round")
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(60) == 0, log(c)[-3000:]
        assert not [r for n in (a, b, c) for r in trained(n) if held <= int(r["round"]) <= numbered], "R was recorded"
        assert any(int(r["round"]) < held and r["peers"] > 1 for r in trained(c)), "c never trained with a and b"
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total


def test_a_restarted_holder_of_the_newest_round_does_not_wait_for_peers_that_are_all_down(tmp_path, data):
    """Both nodes SIGKILLed, one after the other; the last one comes back holding the run's newest
    round, and the coordinator lists no other live trainer: nobody can serve it a newer state, so it trains on at
    once instead of looking for peers in the DHT until its rendezvous deadline (60 s here; 8 s of a
    24 s stall in a chaos testnet at a 5 s MTBF)."""
    deadline_s = 60.0
    with churn_net(tmp_path, data, token_uses=4) as net:
        a, b = (net.add_node(extra=["--min-peers", "2"]) for _ in range(2))
        for node in (a, b):
            wait_rounds(node, 3, timeout_s=WAIT_S)
        # b first: a trains on alone, so a's checkpoint holds the run's newest round (a round's
        # checkpoint is written before its state is published, hence before anyone hears of it).
        net.kill_node(b)
        wait_for(lambda: len([r for r in trained(a) if r["peers"] == 1]) >= 2, WAIT_S, what="a to train alone")
        net.kill_node(a)
        mine = last_round(a)
        since = len(log(a))
        restarted_at = time.time()
        net.start_node(a, extra=["--rendezvous-deadline", f"{deadline_s:g}"])
        wait_log(a, r"resumed from the local checkpoint", timeout_s=WAIT_S, since=since)
        wait_for(lambda: last_round(a) > mine, WAIT_S, what="a's next round")
        first = min(float(r["time"]) for r in trained(a) if int(r["round"]) > mine)
        # Its start-up (imports, DHT) included, far below the deadline it no longer waits out.
        assert first - restarted_at < deadline_s / 2, first - restarted_at
        assert "nobody serves" not in log(a)[since:]  # it did not renumber: nothing was ahead of it


def test_two_restarts_behind_the_run_at_once_number_one_state_as_its_round(tmp_path, data):
    """C is killed, then B a few rounds later, then A (alone by then) a few rounds after that: every
    holder of the run's newest rounds is dead. B and C come back at the same moment from different
    checkpoints and each waits 5 s for a state nobody serves. Only one may go on numbered as the
    run's newest round (the coordinator grants that number to one process); the other takes its
    state. The one granted holds 10 s before it goes on (`delay:lost_rounds`), so the other one
    claims too whatever their start-up times (else it would see the first one's state before its
    own wait ends): both numbering their own states as the run's newest round gave that round
    two states, and every later round was averaged from two bases."""
    with churn_net(tmp_path, data, token_uses=12) as net:
        a, b, c = (net.add_node(extra=["--min-peers", "3"]) for _ in range(3))
        for node in (a, b, c):
            wait_rounds(node, 2, timeout_s=WAIT_S)
        net.kill_node(c)
        wait_for(lambda: last_round(b) >= last_round(c) + 2, WAIT_S, what="a and b to go on without c")
        net.kill_node(b)
        wait_for(lambda: last_round(a) >= last_round(b) + 2, WAIT_S, what="a to go on alone")
        net.kill_node(a)
        run_at = last_round(a)
        since = {n.name: len(log(n)) for n in (b, c)}
        for node in (b, c):
            net.start_node(node, extra=["--state-fetch-timeout", "5", "--fault", "delay:lost_rounds:10"])
        went_on = r"going on from this node's round \d+ as round (\d+)"
        for node in (b, c):
            wait_log(node, rf"{went_on}|took the global state", timeout_s=WAIT_S, since=since[node.name])
        numbered = [n for n in (b, c) if re.search(went_on, log(n)[since[n.name]:])]
        assert len(numbered) == 1, [log(n)[since[n.name]:][-1500:] for n in (b, c)]
        (refused,) = [n for n in (b, c) if n is not numbered[0]]
        assert "not numbering this node's state as round" in log(refused)[since[refused.name]:]
        train_on_together(net, b, c, past=run_at)
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total
