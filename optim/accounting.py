"""Byte accounting: every payload byte a worker puts on (or takes off) the wire, by codec."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ByteCounter:
    sent: dict[str, int] = field(default_factory=dict)      # codec -> bytes this worker sent
    received: dict[str, int] = field(default_factory=dict)  # codec -> bytes this worker received
    rounds: int = 0

    def add(self, codec: str, sent: int, received: int) -> None:
        self.sent[codec] = self.sent.get(codec, 0) + int(sent)
        self.received[codec] = self.received.get(codec, 0) + int(received)
        self.rounds += 1

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    def to_dict(self) -> dict[str, object]:
        return {"sent": dict(self.sent), "received": dict(self.received), "rounds": self.rounds,
                "total_sent": self.total_sent, "total_received": self.total_received}
