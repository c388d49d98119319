"""What the checksums of protocol/integrity.py cost: the hash rate, a checkpoint's write with its
checksum hashed on the way out, and the streaming check a node runs on its checkpoint before it
joins, with the check's peak memory (it must not hold the file: a 2 GB checkpoint beside a 2 GB
model would double the node's memory).

Rows (each the median of --repeats, interleaved):

  sha256_memory      hashlib.sha256 over --mb MiB already in memory (the pure hash rate)
  save_checksummed   node/daemon/checkpoint_file.py's save (the tensors' bytes hashed as written), fsynced
  save_plain         the same bytes written by the same loop without the hash, fsynced (the baseline)
  verify_streaming   checkpoint_file.verify on the file just written (page cache warm: the hash, not the disk)

and, in a fresh process, verify's peak RSS over the interpreter's and torch's (`verify_peak_rss_mib`).

    nice .venv/bin/python benchmarks/checksum.py [--mb 256] [--repeats 3]

Writes benchmarks/results/checksum.json with the device, date, load, command, commit and rows.
On the GPU box: `source benchmarks/gpu_env.sh && python3 benchmarks/checksum.py --mb 2048`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpoint_bench import ROOT, checkpoint_state, head, interleaved, median, timed, write  # noqa: E402

from murmur.node.daemon import checkpoint_file  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "checksum.json"


def save_plain(state: dict, path: Path) -> None:
    """checkpoint_file.save's writes without the hash: the same structure, the same raw writes."""
    import io

    tensors: list[torch.Tensor] = []
    refs: list = []
    tree = checkpoint_file._strip(state, tensors, refs)
    head = io.BytesIO()
    torch.save({"tree": tree, "tensors": refs}, head)
    structure = head.getvalue()
    with open(path, "wb", buffering=0) as f:
        checkpoint_file._write_all(f, memoryview(checkpoint_file.MAGIC + len(structure).to_bytes(8, "little")
                                                 + structure))
        pos = 0
        for t, ref in zip(tensors, refs, strict=True):
            if ref.offset > pos:
                checkpoint_file._write_all(f, memoryview(bytes(ref.offset - pos)))
            checkpoint_file._write_all(f, checkpoint_file._bytes_of(t))
            pos = ref.offset + ref.nbytes
        os.fsync(f.fileno())


PEAK = """
import resource, sys
from pathlib import Path
import torch  # noqa: F401 - the baseline includes torch, as a node's does
from murmur.node.daemon import checkpoint_file
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
checkpoint_file.verify(Path(sys.argv[1]))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) / 1024)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="checkpoint size in MiB (fp32 tensors of 64 MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    state, mib = checkpoint_state(args.mb)
    blob = memoryview(torch.cat([t for t in state["model"].values()]).view(torch.uint8).numpy())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        plain = Path(tmp) / "plain.pt"
        runs = interleaved({
            "sha256_memory": lambda: timed(lambda: hashlib.sha256(blob).digest()),
            "save_checksummed": lambda: timed(lambda: checkpoint_file.save(state, path)),
            "save_plain": lambda: timed(lambda: save_plain(state, plain)),
            "verify_streaming": lambda: timed(lambda: checkpoint_file.verify(path)),
        }, args.repeats, show=lambda name, s: print(f"{name:18s} {s:.3f} s", flush=True))
        peak = float(subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True,
                                    check=True).stdout.strip())
    rows = [
        {"what": name, "mib": mib, "seconds": round(median(r), 4), "seconds_runs": [round(x, 4) for x in r],
         "mib_per_s": round(mib / median(r), 1)}
        for name, r in runs.items()
    ]
    result = {
        **head("checksum", "benchmarks/checksum.py", prefix="nice .venv/bin/python"),
        "checkpoint_mib": mib,
        "verify_peak_rss_mib": round(peak, 1),
        "rows": rows,
    }
    write(args.results, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
