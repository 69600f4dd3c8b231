"""PyTorch reference for Strata's tests and benchmarks.

The same GPT as Strata's (nanoGPT layout: learned positions, pre-LayerNorm, GELU-tanh,
tied embeddings) and the same LLaMA (RMSNorm, rotary positions, grouped-query attention,
SwiGLU), written in plain PyTorch eager, with two commands:

  train  replays given batches from given initial weights and prints the loss of every
         step as JSON, so Strata's losses can be compared with PyTorch's step by step;
  bench  trains a freshly initialised model on random walks over the vocabulary (each
         token 1 to 8 past the one before) in blocks of steps asked for
         on stdin, answering each with its time, its last loss and the peak memory as a
         JSON line; on a GPU (--device cuda) with autocast (--amp bf16) and the fused AdamW;
         with --compile the model runs through torch.compile, with --checkpoint each block
         is recomputed in backward.

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


def run_block(model, block, *inputs):
    """A block's forward; recomputed in backward where the model says so (`recompute`)."""
    if getattr(model, "recompute", False) and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block, *inputs, use_reentrant=False)
    return block(*inputs)


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
            x = run_block(self, block, x)
        return self.lm_head(self.transformer.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn_dim, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(dim, dim, bias=False)
        self.self_attn.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.mlp.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.mlp.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        a = self.self_attn
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + a.o_proj(y.transpose(1, 2).reshape(b, t, c))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Llama(nn.Module):
    """LLaMA as Strata lays it out: RMSNorm, rotary positions (half rotation), grouped-query
    attention, SwiGLU, untied head."""

    def __init__(self, vocab, ctx, layers, heads, dim, kv_heads, ffn_dim, eps=1e-5, theta=10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, ffn_dim, eps) for _ in range(layers))
        self.norm = RMSNorm(dim, eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(ctx, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx):
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = run_block(self, block, x, cos, sin)
        return self.lm_head(self.norm(x))


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


def forward_loss(model, x, y, amp):
    """The mean next-token loss, the model under autocast, the loss in fp32."""
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_step(model, opt, x, y, grad_clip, amp=None, mark=lambda phase: None, loss_of=forward_loss):
    """One step; mark(phase) is called as each of PHASES begins."""
    mark(PHASES[0])
    loss = loss_of(model, x, y, amp)
    mark(PHASES[1])
    loss.backward()
    mark(PHASES[2])
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad()
    mark(PHASES[3])
    return loss


# The parts of a step timed on the GPU, as Strata's bench names them.
PHASES = ("1 forward and loss", "2 backward", "3 clipping and update", "4 after the update")


def phase_times(step):
    """GPU milliseconds of each part of step(mark), from CUDA events recorded at the marks."""
    marks = []

    def mark(phase):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((phase, event))

    torch.cuda.synchronize()
    step(mark)
    mark("end")
    torch.cuda.synchronize()
    return {a[0]: a[1].elapsed_time(b[1]) for a, b in zip(marks, marks[1:])}


def make_optimizer(model, args):
    # On a GPU the fused AdamW, as a user tuning for speed would choose.
    fused = next(model.parameters()).is_cuda or None
    params = list(model.parameters())
    if args.decay_norms_and_biases == "false":
        # LayerNorms and biases without weight decay, as transformers' Trainer groups them.
        norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
        skipped = [p for n, p in model.named_parameters() if id(p) in norms or "bias" in n]
        kept = [p for p in params if all(p is not q for q in skipped)]
        params = [{"params": kept}, {"params": skipped, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        params,
        lr=args.lr,
        betas=tuple(args.betas),
        eps=args.eps,
        weight_decay=args.weight_decay,
        fused=fused,
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


def split(batch):
    return batch[:, :-1], batch[:, 1:]


def count_syncs(step):
    """Runs step() once and counts the host-device synchronisations CUDA's sync debug mode
    reports in it."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in seen)


def trace_step(step, path):
    """Runs step() once under torch.profiler (operators, and a GPU's kernels) and writes its
    Chrome trace to path."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with warnings.catch_warnings():
        # One recording cycle is all there is: its note about later cycles does not apply.
        warnings.simplefilter("ignore")
        with profile(activities=activities, record_shapes=True) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        prof.export_chrome_trace(path)


def random_walks(vocab, rows, length, gen):
    """Rows of tokens each 1 to 8 past the one before (modulo the vocabulary), from random
    starts: a rule a model learns within tens of steps, so losses after a few steps compare
    runs, and one no model memorises from a few batches."""
    start = torch.randint(vocab, (rows, 1), generator=gen)
    steps = torch.randint(1, 9, (rows, length - 1), generator=gen)
    return torch.cat([start, start + steps.cumsum(1)], 1) % vocab


def cmd_bench(args):
    """Serves timed blocks of training steps: reads "K" lines from stdin, runs K steps and
    answers with one JSON line, so a caller can alternate blocks with its own; an "inspect"
    line runs one step and answers with the host-device synchronisations it made, and then
    another with the GPU time of each of its parts; a "trace PATH" line runs one step under
    torch.profiler and writes its Chrome trace to PATH."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if args.model == "gpt":
        model = GPT(args.vocab, args.ctx, args.layers, args.heads, args.dim)
    else:
        kv_heads = args.kv_heads or args.heads
        ffn_dim = args.ffn_dim or (8 * args.dim // 3 + 31) // 32 * 32
        model = Llama(args.vocab, args.ctx, args.layers, args.heads, args.dim, kv_heads, ffn_dim)
    model.to(device)
    model.recompute = args.checkpoint
    opt = make_optimizer(model, args)
    # torch.compile takes the forward and the loss together (as a model computing its own
    # loss would be compiled), so the loss's upcast and softmax fuse too.
    loss_of = torch.compile(forward_loss) if args.compile else forward_loss
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    gen = torch.Generator().manual_seed(args.seed)
    batches = [random_walks(args.vocab, args.batch, args.ctx + 1, gen).to(device) for _ in range(16)]
    cuda = device.type == "cuda"
    step = 0
    for line in sys.stdin:
        if line.strip() == "inspect":
            syncs = count_syncs(lambda: train_step(model, opt, *split(batches[0]), args.grad_clip, amp, loss_of=loss_of))
            phases = phase_times(lambda mark: train_step(model, opt, *split(batches[0]), args.grad_clip, amp, mark, loss_of))
            print(json.dumps({"syncs": syncs, "phases_ms": phases}), flush=True)
            continue
        if line.startswith("trace "):
            path = line[len("trace ") :].strip()
            trace_step(lambda: train_step(model, opt, *split(batches[0]), args.grad_clip, amp, loss_of=loss_of), path)
            print(json.dumps({"trace": path}), flush=True)
            continue
        k = int(line)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(k):
            loss = train_step(model, opt, *split(batches[step % len(batches)]), args.grad_clip, amp, loss_of=loss_of)
            step += 1
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        answer = {"seconds": elapsed, "steps": k, "loss": loss.item(), "peak_rss_bytes": peak_rss_bytes()}
        if args.compile:
            # Graphs torch.compile made: none would mean the step ran eagerly.
            answer["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if cuda:
            answer["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        print(json.dumps(answer), flush=True)


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
        s.add_argument("--decay-norms-and-biases", choices=("true", "false"), default="true")
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
    b.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    b.add_argument("--ffn-dim", type=int, default=None)
    b.add_argument("--kv-heads", type=int, default=None)
    b.add_argument("--device", default="cpu")
    b.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none")
    b.add_argument("--compile", action="store_true")
    b.add_argument("--checkpoint", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    {"train": cmd_train, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    main()
