"""Per-rank memory of `strata train --nproc N` over a large token file against a small one.

Writes a raw `u16` token file of `--gib` GiB (ids below the model's vocabulary) and one of
1 MiB, then trains on each at every `--ctx` given, sampling every rank's `/proc/PID/status`
while it runs: the peak of its anonymous memory (`RssAnon`: what the process allocated) and
of its file-backed pages (`RssFile`: the mapped token file, shared with the page cache).
Prints a table, or JSON with `--json`.

    .venv/bin/python scripts/token_file_memory.py --strata target/release/strata \
        --gib 3 --nproc 4 --ctx 512,16
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def write_tokens(path, count, vocab, seed):
    rng = np.random.default_rng(seed)
    chunk = 1 << 26
    with open(path, "wb") as out:
        left = count
        while left > 0:
            n = min(chunk, left)
            out.write(rng.integers(0, vocab, n, dtype=np.uint16).tobytes())
            left -= n


def children(pid):
    """Every descendant of `pid` (the launcher's ranks)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        path = f"/proc/{parent}/task/{parent}/children"
        try:
            with open(path) as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        found += kids
        frontier += kids
    return found


def rss(pid):
    """(RssAnon, RssFile) of `pid` in KiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["RssAnon"].split()[0]), int(fields["RssFile"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def is_rank(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0RANK=" in b"\0" + f.read()
    except OSError:
        return False


def run(args, data, ctx):
    cmd = [
        args.strata, "train", "--model", "gpt", "--vocab", str(args.vocab), "--layers", "2",
        "--heads", "4", "--dim", "128", "--ctx", str(ctx), "--batch-size", str(args.batch_size),
        "--steps", str(args.steps), "--nproc", str(args.nproc), "--token-file", data,
        "--token-width", "u16", "--log-every", "1000",
    ]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peaks = {}
    while launcher.poll() is None:
        for pid in children(launcher.pid):
            if not is_rank(pid):
                continue
            sample = rss(pid)
            if sample is not None:
                anon, file = peaks.get(pid, (0, 0))
                peaks[pid] = (max(anon, sample[0]), max(file, sample[1]))
        time.sleep(0.05)
    if launcher.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{launcher.stderr.read().decode()}")
    mib = lambda kib: kib / 1024
    return {
        "anon_mib": sorted(round(mib(a)) for a, _ in peaks.values()),
        "file_mib": sorted(round(mib(f)) for _, f in peaks.values()),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strata", default="target/release/strata")
    p.add_argument("--gib", type=float, default=3.0)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ctx", default="512,16")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dir", help="where the token files are written (a temporary folder by default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as dir:
        big, small = os.path.join(dir, "big.bin"), os.path.join(dir, "small.bin")
        write_tokens(big, int(args.gib * (1 << 30)) // 2, args.vocab, 0)
        write_tokens(small, (1 << 20) // 2, args.vocab, 1)
        rows = []
        for ctx in [int(c) for c in args.ctx.split(",")]:
            for name, path in [("large", big), ("1 MiB", small)]:
                r = run(args, path, ctx)
                rows.append({"file": name, "bytes": os.path.getsize(path), "ctx": ctx, **r})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.nproc} ranks, GPT 2 × 128, batch {args.batch_size}, {args.steps} steps; per-rank peaks")
    print(f"{'file':>8} {'ctx':>5} {'anonymous MiB':>22} {'file-backed MiB':>22}")
    for r in rows:
        span = lambda v: f"{v[0]}–{v[-1]}" if v else "-"
        print(f"{r['file']:>8} {r['ctx']:>5} {span(r['anon_mib']):>22} {span(r['file_mib']):>22}")


if __name__ == "__main__":
    main()
