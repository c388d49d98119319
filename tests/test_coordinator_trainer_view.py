"""coordinator/trainer_view.py: the live-trainer view is built once per change, versioned, and a
trainer's new round reaches it within one tick rather than rebuilding it for every report."""

from murmur.coordinator.trainer_view import TrainerViews
from murmur.coordinator.trainers import Trainers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def views(tick_s: float = 1.0):
    clock = Clock()
    trainers = Trainers(settle_s=0.0, clock=clock)
    gone: set[str] = set()
    live = lambda run: trainers.live(run, lambda n: n not in gone)  # noqa: E731
    return trainers, TrainerViews(trainers, live, tick_s, clock=clock), clock, gone


def names(view) -> list[str]:
    return [m.node_id for m in view.members]


def test_an_unchanged_view_keeps_its_version_and_its_list():
    trainers, v, _, _ = views()
    trainers.update("a", "run", "i1", "h:1", 0, "00")
    trainers.update("b", "run", "i2", "h:2", 0, "00")
    first = v.get("run")
    assert names(first) == ["a", "b"]
    trainers.update("a", "run", "i1", "h:1", 0, "00")  # the same heartbeat again: nothing changed
    assert v.get("run") is first and v.get("run").version == first.version


def test_a_trainer_that_comes_goes_or_restarts_is_in_the_next_view_at_once():
    trainers, v, _, gone = views()
    trainers.update("a", "run", "i1", "h:1", 0, "00")
    one = v.get("run").version
    trainers.update("b", "run", "i2", "h:2", 0, "00")
    two = v.get("run")
    assert names(two) == ["a", "b"] and two.version > one
    trainers.drop("b")
    assert names(v.get("run")) == ["a"]
    trainers.update("a", "run", "i9", "h:1", 0, "00")  # restarted: a new incarnation
    assert [m.incarnation for m in v.get("run").members] == ["i9"]
    gone.add("a")
    trainers.drop("a")
    assert names(v.get("run")) == []


def test_new_rounds_reach_the_view_within_a_tick_and_a_fresh_ask_at_once():
    trainers, v, clock, _ = views(tick_s=1.0)
    trainers.update("a", "run", "i1", "h:1", 0, "00")
    before = v.get("run")
    trainers.update("a", "run", "i1", "h:1", 1, "11")
    assert v.get("run").members[0].round == 0  # coalesced: the tick has not passed
    assert v.get("run", fresh=True).members[0].round == 1  # a ReportGone reply builds it now
    trainers.update("a", "run", "i1", "h:1", 2, "22")
    clock.now += 1.0
    after = v.get("run")
    assert after.members[0].round == 2 and after.version > before.version


def test_another_runs_change_does_not_change_this_runs_version():
    trainers, v, _, _ = views()
    trainers.update("a", "run", "i1", "h:1", 0, "00")
    mine = v.get("run").version
    trainers.update("x", "other", "i3", "h:3", 0, "00")
    assert v.get("run").version == mine and names(v.get("other")) == ["x"]


def test_a_node_holding_a_recent_version_is_sent_only_what_changed_since():
    trainers, v, _, _ = views()
    for n in "abc":
        trainers.update(n, "run", f"i{n}", f"h:{n}", 0, "00")
    held = v.get("run").version
    trainers.drop("b")
    trainers.update("d", "run", "id", "h:d", 0, "00")
    trainers.update("c", "run", "ic2", "h:c", 0, "00")  # c restarted
    now = v.get("run")
    delta = v.delta("run", now, held)
    assert sorted(m.node_id for m in delta.changed) == ["c", "d"] and delta.removed == ["b"]
    assert v.delta("run", now, held) is delta  # computed once per pair
    assert v.delta("run", now, 12345) is None  # a version this process never built: the whole view


def test_a_member_client_builds_the_view_from_whole_delta_and_unchanged_replies():
    from murmur.protocol import coordinator_pb2 as pb
    from murmur.protocol.coordinator_client import MemberClient

    client = MemberClient.__new__(MemberClient)  # no channel: only the view's bookkeeping
    client.view_version, client.view_members = 0, {}

    def member(n: str, r: int = 0) -> pb.LiveMember:
        return pb.LiveMember(node_id=n, incarnation="i", peer_address="h:1", round=r)

    whole = pb.HeartbeatReply(view_whole=True, view_version=7, members=[member("b"), member("a")])
    client.take_view(whole)
    assert [m.node_id for m in client.members(whole)] == ["b", "a"] and client.view_version == 7
    delta = pb.HeartbeatReply(view_whole=True, view_version=8, view_delta=True, members=[member("c"), member("a", 2)],
                              view_removed=["b"])
    client.take_view(delta)
    assert [(m.node_id, m.round) for m in client.members(delta)] == [("a", 2), ("c", 0)]
    same = pb.HeartbeatReply(view_whole=True, view_version=8, view_unchanged=True)
    client.take_view(same)
    assert [m.node_id for m in client.members(same)] == ["a", "c"] and client.view_version == 8


def every_field_set(message) -> None:
    """Give every field of ``message`` (but a HeartbeatReply's members) a value other than its
    default, nested messages one level down: a field added to the reply later is covered too."""
    from google.protobuf.descriptor import FieldDescriptor as F

    for f in message.DESCRIPTOR.fields:
        if f.name == "members":
            continue
        if f.type == F.TYPE_MESSAGE:
            inner = getattr(message, f.name).add() if f.is_repeated else getattr(message, f.name)
            for g in inner.DESCRIPTOR.fields:  # one level: their own scalars
                if g.type != F.TYPE_MESSAGE:
                    _set(inner, g, F)
            if not f.is_repeated:
                getattr(message, f.name).SetInParent()
        else:
            _set(message, f, F)


def _set(message, f, F) -> None:
    value = {F.TYPE_STRING: f"{f.name}-value", F.TYPE_BYTES: f.name.encode(), F.TYPE_BOOL: True,
             F.TYPE_DOUBLE: 2.5, F.TYPE_FLOAT: 1.5}.get(f.type, 7)  # the rest: integers and enums
    if f.is_repeated:
        getattr(message, f.name).append(value)
    else:
        setattr(message, f.name, value)


def test_a_reply_with_the_views_bytes_appended_parses_as_the_one_built_member_by_member():
    """coordinator/preserialized.py: the whole view goes as bytes serialized once per version, and
    the reply's other fields serialized apart; what a node parses is the reply built the old way."""
    from murmur.coordinator.preserialized import BeatReply
    from murmur.protocol import coordinator_pb2 as pb

    trainers, v, _, _ = views()
    for i in range(50):
        trainers.update(f"node-{i:03d}", "run", f"inc-{i}", f"10.0.0.{i}:7800", i % 3, f"{i:064x}")
    view = v.get("run")
    rest = pb.HeartbeatReply()
    every_field_set(rest)
    assert {f.name for f, _ in rest.ListFields()} == {f.name for f in pb.HeartbeatReply.DESCRIPTOR.fields} - {"members"}
    old = pb.HeartbeatReply()
    old.CopyFrom(rest)
    old.members.extend(view.members)

    sent = BeatReply(rest, view.members_field())
    wire = sent.wire()
    assert sent.size() == len(wire) == old.ByteSize()  # sized without being assembled (the datagram check)
    parsed = pb.HeartbeatReply.FromString(wire)
    assert parsed == old and parsed.SerializeToString() == old.SerializeToString()
    assert [m.node_id for m in parsed.members] == [f"node-{i:03d}" for i in range(50)]
    assert sent.for_grpc() == wire  # bytes, passed through by the gRPC registration as they are
    assert BeatReply(rest).for_grpc() is rest  # no whole view (a delta, unchanged): the message itself
    assert view.members_field() is view.members_field()  # made once for the version


def test_the_views_bytes_are_made_again_for_a_new_version_and_never_serve_an_old_one():
    from murmur.protocol import coordinator_pb2 as pb

    def listed(view) -> list[str]:
        return [m.node_id for m in pb.HeartbeatReply.FromString(view.members_field()).members]

    trainers, v, clock, gone = views()
    trainers.update("a", "run", "i1", "h:1", 0, "00")
    trainers.update("b", "run", "i2", "h:2", 0, "00")
    first = v.get("run")
    assert listed(first) == ["a", "b"]
    trainers.update("a", "run", "i1", "h:1", 0, "00")  # nothing changed: the same version, its bytes kept
    assert v.get("run") is first and listed(v.get("run")) == ["a", "b"]
    trainers.update("c", "run", "i3", "h:3", 0, "00")  # a trainer joins
    joined = v.get("run")
    assert joined.version != first.version and listed(joined) == ["a", "b", "c"]
    gone.add("b")
    trainers.drop("b")  # a trainer goes
    left = v.get("run")
    assert left.version != joined.version and listed(left) == ["a", "c"]
    trainers.update("a", "run", "i1", "h:1", 4, "44")  # a new round, past the tick
    clock.now += 1.0
    moved = v.get("run")
    assert moved.version != left.version
    assert [(m.node_id, m.round) for m in pb.HeartbeatReply.FromString(moved.members_field()).members] == [
        ("a", 4), ("c", 0)]
    assert listed(joined) == ["a", "b", "c"]  # each version's bytes are its own list
