"""PyTorch reference for `strata bench comm`: the same collectives, sizes and timing rule
over torch.distributed's gloo backend, in N processes of this host joined over loopback.

Prints one JSON object, {"rows": [{"op", "bytes", "time_us"}, ...]}, from rank 0. A row's
time is the slowest rank's mean over the timed runs, as in Strata's benchmark.

Run it with the project's virtual environment:
  .venv/bin/python scripts/torch_comm_reference.py --nproc 2 --ops all_reduce
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import finish, spawn_on_loopback  # noqa: E402


def time_op(op, nbytes, n, warmup):
    numel = nbytes // 4
    if op in ("all_reduce", "broadcast"):
        main, whole = torch.ones(numel), None
    else:
        per = numel // n
        main, whole = torch.ones(per), torch.ones(per * n)
    output = torch.ones(whole.numel()) if whole is not None else None

    def run():
        if op == "all_reduce":
            dist.all_reduce(main)
        elif op == "broadcast":
            dist.broadcast(main, 0)
        elif op == "all_gather":
            dist.all_gather_into_tensor(whole, main)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(main, whole)
        elif op == "all_to_all":
            # Every rank's whole buffer in blocks, one to each rank.
            dist.all_to_all_single(output, whole)
        else:
            raise SystemExit(f"unknown operation {op!r}")

    for _ in range(warmup):
        run()
    iters = max(3, min(100, (1 << 30) // max(nbytes, 1)))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(rank, args, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    rows = []
    for op in args.ops.split(","):
        nbytes = args.min_bytes
        while nbytes <= args.max_bytes:
            rows.append({"op": op, "bytes": nbytes, "time_us": time_op(op, nbytes, args.nproc, args.warmup) * 1e6})
            nbytes *= args.factor
    if rank == 0:
        print(json.dumps({"rows": rows}), flush=True)
    finish()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--warmup", type=int, default=8, help="untimed runs before each row's timed ones")
    args = p.parse_args()
    spawn_on_loopback(worker, args, args.nproc)


if __name__ == "__main__":
    main()
