"""Where a traced round's time went: ``benchmarks/exchange_trace.py DIR [--window A B]``.

Reads what ``benchmarks/exchange.py --trace DIR`` wrote. Per round and peer: when its first input
chunk went to gRPC, when its upload stopped moving, when the round completed there, how long the
result's hash took, and the mid-round shortfall (seconds of link below 90% of the rate, weighted
by how far below, between the first chunk and the last byte). ``--window A B`` lists every event
and the upload rate of each peer between A and B seconds after the round's last start.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(d: Path, r: str):
    peers = [json.loads(p.read_text()) for p in sorted(d.glob(f"peer*_round{r}.json"))]
    samples = json.loads((d / f"link_round{r}.json").read_text())
    return peers, samples, max(p["start"] for p in peers)


def breakdown(d: Path, r: str, rate: float) -> None:
    peers, samples, t0 = load(d, r)
    link = rate * 1e6 / 8
    print(f"round {r}: {max(p['end'] for p in peers) - t0:.2f} s")
    for i, p in enumerate(peers):
        ev = p["events"]
        first = min(t for t, e, _ in ev if e == "in_w0") - t0
        done = max(t for t, e, _ in ev if e == "complete") - t0
        hashed = max(t for t, e, _ in ev if e == "hashed") - t0
        up = [(t - t0, b[i]) for t, b in samples]
        moving = [(a[0], b[0]) for a, b in zip(up, up[1:], strict=False) if b[1] - a[1] > 2000]
        stop = moving[-1][1] if moving else first
        short = 0.0
        for a, b in zip(up, up[1:], strict=False):
            if a[0] >= first and b[0] <= stop:
                u = (b[1] - a[1]) / (b[0] - a[0]) / link
                short += (b[0] - a[0]) * max(0.0, 0.9 - u) / 0.9
        print(
            f"  peer {i}: first chunk {first:.2f} s, upload stops {stop:.2f} s, complete {done:.2f} s, "
            f"hash {hashed - done:.2f} s, end {p['end'] - t0:.2f} s, mid-round shortfall {short:.1f} s"
        )


def window(d: Path, r: str, a: float, b: float, rate: float) -> None:
    peers, samples, t0 = load(d, r)
    rows = []
    for i, p in enumerate(peers):
        for t, e, f in p["events"]:
            if a <= t - t0 <= b:
                rows.append((t - t0, f"peer {i} {e} " + " ".join(f"{k}={v}" for k, v in f.items())))
    for (ta, xa), (tb, xb) in zip(samples, samples[1:], strict=False):
        if a <= ta - t0 <= b:
            rates = " ".join(f"{(y - x) / (tb - ta) / (rate * 1e6 / 8):4.0%}" for x, y in zip(xa, xb, strict=True))
            rows.append((ta - t0, f"   upload {rates}"))
    for t, s in sorted(rows):
        print(f"{t:8.3f} {s}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--rate", type=float, default=100.0, help="the link's Mbit/s")
    ap.add_argument("--window", type=float, nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    d = Path(args.dir)
    for f in sorted(d.glob("link_round*.json")):
        r = f.stem.removeprefix("link_round")
        if args.window:
            window(d, r, *args.window, args.rate)
        else:
            breakdown(d, r, args.rate)


if __name__ == "__main__":
    main()
