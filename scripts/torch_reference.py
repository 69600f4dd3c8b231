"""PyTorch reference for Strata's tests and benchmarks.

The same GPT as Strata's (nanoGPT layout: learned positions, pre-LayerNorm, GELU-tanh,
tied embeddings), written in plain PyTorch eager, with two commands:

  train  replays given batches from given initial weights and prints the loss of every
         step as JSON, so Strata's losses can be compared with PyTorch's step by step;
  bench  trains a freshly initialised model on random tokens in blocks of steps asked for
         on stdin, answering each with its time and the peak memory as a JSON line.

Run it with the project's virtual environment: .venv/bin/python scripts/torch_reference.py
"""

import argparse
import json
import math
import resource
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(dim, 3 * dim)
        self.attn.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, layers, heads, dim):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, dim)
        self.transformer.wpe = nn.Embedding(ctx, dim)
        self.transformer.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def spawn_on_loopback(worker, args, nprocs):
    """Runs worker(rank, args, port) in `nprocs` processes that can join over a free
    loopback port (torch.distributed's tcp:// init)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=nprocs)


def finish():
    """Ends a rank of a spawned job once every rank is done: a barrier, then an exit that
    skips the interpreter's teardown, in which gloo's background threads sometimes abort
    the process ("terminate called without an active exception") after the work is done."""
    import os

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train_step(model, opt, x, y, grad_clip):
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad()
    return loss


def make_optimizer(model, args):
    return torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=tuple(args.betas), eps=args.eps, weight_decay=args.weight_decay
    )


def cmd_train(args):
    from safetensors.torch import load_file

    weights = load_file(args.weights)
    vocab, dim = weights["transformer.wte.weight"].shape
    ctx = weights["transformer.wpe.weight"].shape[0]
    layers = len({k.split(".")[2] for k in weights if k.startswith("transformer.h.")})
    model = GPT(vocab, ctx, layers, args.heads, dim)
    weights.setdefault("lm_head.weight", weights["transformer.wte.weight"])
    model.load_state_dict(weights, strict=True)
    tokens = torch.from_numpy(np.fromfile(args.tokens, dtype="<u2").astype(np.int64))
    with open(args.offsets) as f:
        plan = json.load(f)
    c = plan["ctx"]
    opt = make_optimizer(model, args)
    losses = []
    for offsets in plan["offsets"][: args.steps]:
        x = torch.stack([tokens[o : o + c] for o in offsets])
        y = torch.stack([tokens[o + 1 : o + 1 + c] for o in offsets])
        losses.append(train_step(model, opt, x, y, args.grad_clip).item())
    json.dump({"losses": losses}, sys.stdout)


def cmd_bench(args):
    """Serves timed blocks of training steps: reads "K" lines from stdin, runs K steps and
    answers with one JSON line, so a caller can alternate blocks with its own."""
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.ctx, args.layers, args.heads, args.dim)
    opt = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(args.vocab, (args.batch, args.ctx + 1), generator=gen) for _ in range(4)]
    step = 0
    for line in sys.stdin:
        k = int(line)
        start = time.perf_counter()
        for _ in range(k):
            b = batches[step % len(batches)]
            train_step(model, opt, b[:, :-1], b[:, 1:], args.grad_clip)
            step += 1
        elapsed = time.perf_counter() - start
        print(json.dumps({"seconds": elapsed, "steps": k, "peak_rss_bytes": peak_rss_bytes()}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("train", "bench"):
        s = sub.add_parser(name)
        s.add_argument("--heads", type=int, required=True)
        s.add_argument("--lr", type=float, default=1e-3)
        s.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
        s.add_argument("--eps", type=float, default=1e-8)
        s.add_argument("--weight-decay", type=float, default=0.01)
        s.add_argument("--grad-clip", type=float, default=None)
        s.add_argument("--threads", type=int, default=None)
    t = sub.choices["train"]
    t.add_argument("--weights", required=True)
    t.add_argument("--tokens", required=True)
    t.add_argument("--offsets", required=True)
    t.add_argument("--steps", type=int, required=True)
    b = sub.choices["bench"]
    for flag in ("--vocab", "--ctx", "--layers", "--dim", "--batch"):
        b.add_argument(flag, type=int, required=True)
    b.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    {"train": cmd_train, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    main()
