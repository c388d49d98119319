"""`murmur generate` and `murmur eval` on busy cores: their default threads against torch's.

    nice .venv/bin/python benchmarks/generate_busy.py [--presets tiny,small] [--repeats 2]

Two busy loops (`python -c 'while 1: pass'`, started here and stopped at the end) keep both cores
of the build machine busy, as a volunteer's own node training beside the commands would, on top of
whatever else the machine runs (the load average is recorded). Each row runs the real command as
a user does, a process of its own, on a model of the preset with its seeded initial weights (speed
does not depend on what it learned), in three settings:

    torch default   --threads 0: torch's own choice, one thread a core (the commands' old default)
    default         no flag: one thread on the CPU (node/export/threads.py)
    OMP=1           OMP_NUM_THREADS=1 and --threads 0: the environment's cap the issue measured

generate: 64 new tokens after "ROMEO:", greedy, with the KV cache, tokens/s from the command's own rate line;
eval: --batches 5 of the run's batch, tokens/s from its --output json. The settings are
interleaved within each repeat, so a drift of the machine's load hits all three. Writes
benchmarks/results/generate_busy.json: device, date, load, command, commit, rows {preset, command,
setting, tokens_per_s (median), runs} and, per preset and command, default / OMP=1 and default /
torch default.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "generate_busy.json"
SETTINGS = {"torch default": (["--threads", "0"], {}), "default": ([], {}),
            "OMP=1": (["--threads", "0"], {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})}
RATE = re.compile(r"(\d+) tokens in [\d.]+s \(([\d,.]+) tok/s")
NEW_TOKENS = 64  # default; torch's default threads ran 1.3 tokens/s here: 200 tokens took 150 s a run


def checkpoint(preset: str, folder: Path) -> Path:
    """A `murmur train`-style checkpoint of the preset with its seeded initial weights."""
    import torch

    from murmur.node.model.transformer import Transformer
    from murmur.node.train.build import resolve_model_config
    from murmur.protocol.runconfig import config_from_dict

    cfg = config_from_dict({"model": {"preset": preset}, "data": {"path": str(folder / "data")}})
    model = Transformer(resolve_model_config(cfg, 256), seed=0)
    path = folder / f"{preset}.pt"
    torch.save({"config": cfg.to_dict(), "model": model.state_dict(), "step": 0}, path)
    return path


def run(args: list[str], env: dict[str, str]) -> float:
    done = subprocess.run([sys.executable, "-m", "murmur.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=900, check=True)
    if args[0] == "eval":
        return float(json.loads(done.stdout)["tokens_per_s"])
    m = RATE.search(done.stderr)
    asked = int(args[args.index("--max-new-tokens") + 1])
    assert m and int(m.group(1)) == asked, done.stderr  # no early stop: every row times the same work
    return float(m.group(2).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the commands (default 2: both cores)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="which of the settings, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"generate's tokens (default {NEW_TOKENS})")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    from murmur.node.model.data import prepare

    base_env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    rows = []
    load_before = [round(x, 1) for x in os.getloadavg()]
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            prepare(folder / "data", tokenizer="byte")
            for preset in args.presets.split(","):
                src = str(checkpoint(preset, folder))
                commands = {
                    "generate": ["generate", src, "--prompt", "ROMEO:", "--max-new-tokens", str(args.new_tokens),
                                 "--temperature", "0", "--device", "cpu"],
                    "eval": ["eval", src, "--data", str(folder / "data"), "--batches", "5", "--device", "cpu",
                             "--output", "json"],
                }
                for name, argv in commands.items():
                    chosen = {k: SETTINGS[k] for k in args.settings.split(",")}
                    runs: dict[str, list[float]] = {s: [] for s in chosen}
                    for _ in range(args.repeats):
                        for setting, (extra, env) in chosen.items():
                            runs[setting].append(run([*argv, *extra], {**base_env, **env}))
                            print(f"{preset:6s} {name:8s} {setting:14s} {runs[setting][-1]:10,.1f} tok/s", flush=True)
                    for setting, r in runs.items():
                        rows.append({"preset": preset, "command": name, "setting": setting,
                                     "tokens_per_s": round(statistics.median(r), 1), "runs": [round(x, 1) for x in r]})
    finally:
        for p in busy:
            p.kill()
            p.wait()
    ratios = {}
    for preset in args.presets.split(","):
        for name in ("generate", "eval"):
            med = {r["setting"]: r["tokens_per_s"] for r in rows if r["preset"] == preset and r["command"] == name}
            ratios[f"{preset} {name}"] = {f"default / {other}": round(med["default"] / med[other], 2)
                                          for other in ("OMP=1", "torch default") if "default" in med and other in med}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    result = {
        "benchmark": "generate_busy",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                  f"{args.busy} busy loops beside the commands, shared with other jobs",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_average": {"before": load_before, "after": [round(x, 1) for x in os.getloadavg()]},
        "command": "nice .venv/bin/python " + shlex.join(["benchmarks/generate_busy.py", *sys.argv[1:]]),
        "commit": commit or None,
        "new_tokens": args.new_tokens,
        "ratios": ratios,
        "rows": rows,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
