"""PyTorch reference for `strata bench dist`: the GPT of torch_reference.py (Strata's GPT
in plain PyTorch) trained on random tokens with DistributedDataParallel or FSDP2
(`fully_shard` on every block, then the root) over gloo, in N processes of this host joined
over loopback, each with its share of the global batch.

Prints one JSON object from rank 0: the median tokens/s over the steps after the warm-up
(a step's time is the slowest rank's), and the largest peak RSS of any rank.

Run it with the project's virtual environment:
  .venv/bin/python scripts/torch_dist_reference.py --nproc 2 --mode ddp
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import GPT, finish, peak_rss_bytes, spawn_on_loopback, train_step  # noqa: E402


def wrap(model, mode, n):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (n,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank, args, port):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    torch.manual_seed(args.seed)
    model = wrap(GPT(args.vocab, args.ctx, args.layers, args.heads, args.dim), args.mode, args.nproc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rows = args.batch_size // args.nproc
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    batches = [torch.randint(args.vocab, (rows, args.ctx + 1), generator=gen) for _ in range(4)]
    times = []
    for step in range(args.steps):
        b = batches[step % len(batches)]
        start = time.perf_counter()
        train_step(model, opt, b[:, :-1], b[:, 1:], None)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rss = torch.tensor([float(peak_rss_bytes())], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = args.batch_size * args.ctx
        speeds = [tokens / t for t in slowest.tolist()[args.warmup :]]
        print(json.dumps({"tokens_per_s": statistics.median(speeds), "peak_rss_bytes": int(rss.item())}), flush=True)
    finish()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mode", choices=("ddp", "fsdp"), default="ddp")
    for flag, default in (("--vocab", 256), ("--ctx", 128), ("--layers", 4), ("--heads", 4), ("--dim", 256)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--batch-size", type=int, default=8, help="global rows per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.batch_size % args.nproc or args.steps <= args.warmup:
        raise SystemExit("--batch-size must be a multiple of --nproc, and --steps larger than --warmup")
    spawn_on_loopback(worker, args, args.nproc)


if __name__ == "__main__":
    main()
