"""The loss-vs-traffic frontier of several quality.py calls: which rows no other row beats on both
traffic and loss, and the best row within 3% and within 2% of DDP.

    python3 benchmarks/quality_frontier.py --sections regime_32k,regime_32k_2026_12_05 --name frontier_32k

Reads sections of benchmarks/results/quality.json (each a quality.py result: rows with
``loss_gap_pct`` against that section's own DDP, and ``reduction_vs_ddp``), writes the section
``--name`` back into it and ``quality-<name>.png`` beside it. Runs on the CPU in a second: it
trains nothing. Sections from different warm starts are compared by their gaps, each against its
own DDP, never by their losses.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import best_within, commit, smallest_gap_at, write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ((3.0, 1000.0), (2.0, 250.0))  # issue 39: >= 1000x within 3%, >= 250x within 2%


def points(doc: dict, sections: list[str]) -> list[dict]:
    out = []
    for name in sections:
        section = doc[name]
        for r in section["rows"]:
            if r["algo"] == "ddp" or r.get("loss_gap_pct") is None or not r.get("reduction_vs_ddp"):
                continue
            out.append({"row": r["name"], "section": name, "workers": r["workers"], "seeds": r["seeds"],
                        "reduction_vs_ddp": r["reduction_vs_ddp"], "loss_gap_pct": r["loss_gap_pct"]})
    return out


def on_frontier(p: dict, pts: list[dict]) -> bool:
    """No other point sends at most as much and is at most as far behind, better in one of the two."""
    return not any(q["reduction_vs_ddp"] >= p["reduction_vs_ddp"] and q["loss_gap_pct"] <= p["loss_gap_pct"]
                   and (q["reduction_vs_ddp"], q["loss_gap_pct"]) != (p["reduction_vs_ddp"], p["loss_gap_pct"])
                   for q in pts)


def frontier(doc: dict, sections: list[str]) -> dict:
    pts = points(doc, sections)
    for p in pts:
        p["on_frontier"] = on_frontier(p, pts)
    front = sorted((p for p in pts if p["on_frontier"]), key=lambda p: p["reduction_vs_ddp"])

    summary = {"best_within_3pct": best_within(pts, 3.0), "best_within_2pct": best_within(pts, 2.0),
               "smallest_gap_at_250x": smallest_gap_at(pts, 250.0),
               "smallest_gap_at_1000x": smallest_gap_at(pts, 1000.0)}
    summary["targets_met"] = {f">={floor:g}x within {pct:g}%": any(
        p["reduction_vs_ddp"] >= floor and p["loss_gap_pct"] <= pct for p in pts) for pct, floor in TARGETS}
    return {"sections": sections, "frontier": front, "points": pts, "summary": summary}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for p in result["points"]:
        ax.plot(p["reduction_vs_ddp"], p["loss_gap_pct"], "o", color="C0" if p["on_frontier"] else "0.7",
                markersize=5)
        ax.annotate(f"{p['row']} ({len(p['seeds'])}s)", (p["reduction_vs_ddp"], p["loss_gap_pct"]), fontsize=5,
                    xytext=(3, 2), textcoords="offset points")
    front = result["frontier"]
    ax.step([p["reduction_vs_ddp"] for p in front], [p["loss_gap_pct"] for p in front], where="pre", color="C0",
            label="frontier (the least gap at this traffic cut or more)")
    for pct, floor in TARGETS:
        ax.plot([floor, floor], [0, pct], color="C3", linewidth=1)
        ax.plot([floor], [pct], "x", color="C3")
    ax.plot([], [], "x", color="C3", label="issue 39's targets")
    ax.set_xscale("log")
    ax.set(xlabel="less traffic than DDP (x, log scale)", ylabel="behind DDP at equal tokens (%)",
           title="loss against traffic (each gap against its own call's DDP)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", required=True, help="quality.json sections to compare, comma-separated")
    p.add_argument("--name", required=True, help="the section to write, e.g. frontier_32k")
    p.add_argument("--results", default=str(RESULTS / "quality.json"))
    args = p.parse_args(argv)
    path = Path(args.results)
    doc = json.loads(path.read_text())
    sections = [s for s in args.sections.split(",") if s]
    missing = [s for s in sections if not isinstance(doc.get(s), dict) or "rows" not in doc[s]]
    if missing:
        print(f"error: {path} has no quality.py section {', '.join(missing)}", file=sys.stderr)
        return 2
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": commit(),
              "command": f"python3 benchmarks/quality_frontier.py {argv_text}", **frontier(doc, sections)}
    doc[args.name] = result
    write_json(path, doc)
    plot(result, path.parent / f"quality-{args.name}.png")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
