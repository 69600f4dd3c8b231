"""The `transformers` side of `strata bench long`: one LLaMA (`LlamaForCausalLM`, SDPA
attention), freshly initialised, trained on one row of --ctx random tokens a step with
AdamW, as a user fine-tuning long rows with `transformers` would: fp32 weights under bf16
autocast (--bf16), or with --lora-rank a bf16 base and fp32 adapters on every linear layer
(`peft`, the adapters under autocast); with --checkpoint, every block recomputed
(`activation_checkpointing_enable()`).

Prints one JSON object: the allocator's peak over the steps after the first (on a GPU,
`torch.cuda.max_memory_allocated`; on the CPU, which has no allocator statistics, the
process's peak resident set, marked as such), the median tokens/s of those steps, and
"out_of_memory": true where a step ran out of device memory (then nothing else is measured).

Run it with the project's virtual environment: .venv/bin/python scripts/long_reference.py
"""

import argparse
import json
import resource
import statistics
import time

import torch


def build(args, device):
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.ctx, 2048),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    base_dtype = torch.bfloat16 if args.lora_rank else torch.float32
    # Built where it trains, in its dtype: an 8B model initialised in fp32 on the host first
    # would take minutes a probe.
    with device:
        model = tf.LlamaForCausalLM._from_config(config, dtype=base_dtype)
    if args.checkpoint:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        import peft

        lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
        model = peft.get_peft_model(model, lora)
        if args.checkpoint:
            # The frozen embedding's output takes no gradient: checkpointed blocks need one.
            model.enable_input_require_grads()
    model.train()
    return model


def step(model, opt, ids, amp):
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("layers", 2), ("heads", 4), ("kv-heads", 2), ("dim", 64), ("ffn-dim", 172),
                          ("vocab", 2048), ("ctx", 256), ("steps", 3), ("lora-rank", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (a LoRA base is bf16 either way)")
    p.add_argument("--checkpoint", action="store_true", help="every block recomputed in backward")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2 (one warm-up, one timed)")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    out = {"ctx": args.ctx, "peak_of": "cuda allocator" if on_gpu else "process resident set"}
    gen = torch.Generator().manual_seed(1)
    try:
        model = build(args, device)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=1e-4, fused=on_gpu or None)
        ids = torch.randint(0, args.vocab, (1, args.ctx), generator=gen).to(device)
        loss = step(model, opt, ids, args.bf16 or bool(args.lora_rank))
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        speeds = []
        for _ in range(args.steps - 1):
            start = time.perf_counter()
            loss = step(model, opt, ids, args.bf16 or bool(args.lora_rank))
            if on_gpu:
                torch.cuda.synchronize()
            speeds.append(args.ctx / (time.perf_counter() - start))
    except torch.OutOfMemoryError:
        out["out_of_memory"] = True
        print(json.dumps(out))
        return
    peak = torch.cuda.max_memory_allocated() if on_gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.update(out_of_memory=False, peak_bytes=peak, tokens_per_s=statistics.median(speeds), loss=loss,
               trained_parameters=sum(p.numel() for p in trained))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
