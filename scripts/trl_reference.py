"""TRL reference for Strata's preference-optimisation tests.

  make  saves a model folder: a byte-level BPE tokenizer with a chat template (from
        chat_reference.py's styles) and a tiny random LLaMA over its vocabulary, every weight
        moved off its initial value, drawn from a seed; with --reward, the LLaMA as a
        sequence classifier of one label (a reward model, padded with the end token as TRL
        pads it);
  lora  saves a peft LoRA adapter of a folder's model as peft draws a new one (B = 0), for a
        JSON LoraConfig (task_type SEQ_CLS: of a sequence classifier, its score head among
        the modules saved whole) and a seed; with --move-b, every B moved off zero, and with
        --move-saved, the copies of the modules saved whole moved off the base's, as a
        trained adapter's are;
  runs  runs each run of a JSON list (name, records file, its trainer — "dpo", "kto",
        "cpo", "orpo" or "reward" — and its config's fields: loss_type, loss_weights, beta,
        label_smoothing, f_divergence_type, desirable_weight, undesirable_weight, cpo_alpha,
        simpo_gamma, center_rewards_coefficient;
        a model folder in place of --model; and an adapter folder whose parameters alone
        train) on a folder's model with TRL's DPOTrainer, KTOTrainer or RewardTrainer
        scoring: the dataset tokenized by the trainer, batches by its collator in record
        order, each step's loss from its compute_loss (which logs TRL's metrics),
        torch.optim.AdamW for the update; writes --out/NAME.jsonl, one line a step (loss, the
        metrics TRL logged, the gradient norm), and the trained weights as
        --out/NAME.safetensors (or the adapter as --out/NAME/).
  grpo  runs each run of a JSON list (name and GRPOConfig fields: loss_type, beta, epsilon,
        epsilon_high, delta, importance_sampling_level, scale_rewards, num_iterations,
        mask_truncated_completions; and accumulation, the micro-batches each step splits its
        generation batch into) with TRL's GRPOTrainer on given generation batches
        (--rollouts: a JSON list of {prompts, completions, rewards}, token ids, one prompt per
        completion, groups of --generations consecutive): its generation is replaced by the
        given completions, so the trainer's own scoring, advantages, old and reference
        log-probabilities and loss run on them; each batch trains num_iterations AdamW
        steps; writes --out/NAME.jsonl (loss, gradient norm and the metrics TRL logged, one
        line a step) and the weights as --out/NAME.safetensors.

Several commands separated by "+" run in turn in one process (TRL imported once).

Nothing is downloaded. Run it with the project's virtual environment:
.venv/bin/python scripts/trl_reference.py
"""

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make(style, out, seed, reward):
    import transformers as tf
    from chat_reference import make_tokenizer

    make_tokenizer(style, out)
    tok = tf.AutoTokenizer.from_pretrained(out)
    torch.manual_seed(seed)
    extra = dict(num_labels=1, pad_token_id=tok.pad_token_id or tok.eos_token_id) if reward else {}
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.bos_token_id, **extra)
    model = tf.LlamaForSequenceClassification(config) if reward else tf.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)


def lora(model_dir, out, config, seed, move_b, move_saved):
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**json.loads(config))
    torch.manual_seed(seed)
    load = tf.AutoModelForSequenceClassification if config.task_type == "SEQ_CLS" else tf.AutoModelForCausalLM
    model = get_peft_model(load.from_pretrained(model_dir, dtype=torch.float32), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if move_b and ".lora_B." in name or move_saved and ".modules_to_save." in name:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)


def trainer_run(args, run):
    import transformers as tf
    from datasets import Dataset
    from peft import PeftModel
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    folder = run.get("model", args.model)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    kind = run.get("trainer", "dpo")
    if kind in ("cpo", "orpo") and tok.pad_token is None:
        tok.pad_token = tok.eos_token  # what these trainers ask of a tokenizer without one
    load = tf.AutoModelForSequenceClassification if kind == "reward" else tf.AutoModelForCausalLM
    model = load.from_pretrained(folder, dtype=torch.float32)
    if run.get("adapter"):
        model = PeftModel.from_pretrained(model, run["adapter"], is_trainable=True)
    with open(run["pairs"]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    common = dict(max_length=args.max_length, per_device_train_batch_size=args.batch, bf16=False,
                  gradient_checkpointing=False, report_to=[], use_cpu=True)
    if kind != "reward":
        common["beta"] = run.get("beta", 0.1)
    with tempfile.TemporaryDirectory() as out:
        if kind == "reward":
            config = RewardConfig(output_dir=out, center_rewards_coefficient=run.get("center_rewards_coefficient"),
                                  **common)
            make = RewardTrainer
        elif kind == "cpo":
            config = CPOConfig(output_dir=out, loss_type=run.get("loss_type", "sigmoid"),
                               cpo_alpha=run.get("cpo_alpha", 1.0), simpo_gamma=run.get("simpo_gamma", 0.5),
                               label_smoothing=run.get("label_smoothing", 0.0), **common)
            make = CPOTrainer
        elif kind == "orpo":
            config = ORPOConfig(output_dir=out, **common)
            make = ORPOTrainer
        elif kind == "kto":
            config = KTOConfig(output_dir=out, loss_type=run.get("loss_type", "kto"),
                               desirable_weight=run.get("desirable_weight", 1.0),
                               undesirable_weight=run.get("undesirable_weight", 1.0), **common)
            make = KTOTrainer
        else:
            sync = run.get("sync_steps")
            config = DPOConfig(output_dir=out, loss_type=run.get("loss_type", ["sigmoid"]),
                               loss_weights=run.get("loss_weights"), label_smoothing=run.get("label_smoothing", 0.0),
                               f_divergence_type=run.get("f_divergence", "reverse_kl"), sync_ref_model=bool(sync),
                               ref_model_sync_steps=sync or 512, ref_model_mixup_alpha=run.get("mixup", 0.6), **common)
            make = DPOTrainer
        trainer = make(model=model, args=config, train_dataset=Dataset.from_list(records), processing_class=tok)
    policy = trainer.model
    policy.train()
    trained = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    data = trainer.train_dataset
    lines = []
    for step in range(args.steps):
        rows = [(step * args.batch + i) % len(data) for i in range(args.batch)]
        batch = trainer.data_collator([data[r] for r in rows])
        # CPO and ORPO keep their metrics apart from the others' and as tensors or numbers.
        logged = trainer._stored_metrics["train"] if kind in ("cpo", "orpo") else trainer._metrics["train"]
        logged.clear()
        loss = trainer.compute_loss(policy, batch)
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trained)).item()
        opt.step()
        opt.zero_grad()
        # TR-DPO: TRL's own sync, where its callback would run it (after the step's update).
        if kind == "dpo" and config.sync_ref_model and (step + 1) % config.ref_model_sync_steps == 0:
            from trl.trainer.callbacks import SyncRefModelCallback
            SyncRefModelCallback.sync_target_model(policy, trainer.ref_model, config.ref_model_mixup_alpha)
        metrics = {k: float(v[-1]) for k, v in logged.items() if k != "num_tokens"}
        lines.append(json.dumps({"step": step + 1, "loss": loss.item(), "grad_norm": norm, **metrics}))
    name = os.path.join(args.out, run["name"])
    if run.get("adapter"):
        policy.save_pretrained(name)
    else:
        from safetensors.torch import save_file
        save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, name + ".safetensors")
    with open(name + ".jsonl", "w") as f:
        f.write("\n".join(lines) + "\n")


def grpo_run(args, run, batches):
    import transformers as tf
    from datasets import Dataset
    from safetensors.torch import save_file
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    tok = tf.AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rows = len(batches[0]["completions"])
    given = {}

    def reward(prompts, completions, completion_ids, **kwargs):
        return [None if r is None else float(r) for r in given["batch"]["rewards"]]

    def generate(prompts):
        b = given["batch"]
        texts = [tok.decode(c) for c in b["completions"]]
        return b["prompts"], b["completions"], None, texts, None, None, None, None

    fields = ("loss_type", "beta", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "scale_rewards",
              "num_iterations", "mask_truncated_completions")
    # Micro-batches a step accumulates, each a slice of the generation batch (one per step's
    # worth of it, as TRL splits it); the step's loss is their losses' sum, as the Trainer logs it.
    accumulation = run.get("accumulation", 1)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=rows // accumulation,
                            num_generations=args.generations, max_completion_length=args.max_completion_length,
                            steps_per_generation=accumulation, gradient_accumulation_steps=accumulation, bf16=False,
                            report_to=[], use_cpu=True, gradient_checkpointing=False,
                            **{k: run[k] for k in fields if k in run})
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tok,
                              train_dataset=Dataset.from_list([{"prompt": "p"}] * rows))
    trainer._generate = generate
    trainer.current_gradient_accumulation_steps = accumulation
    policy = trainer.model
    policy.train()
    trained = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    logged = trainer._metrics["train"]
    lines = []
    for b in batches:
        given["batch"] = b
        logged.clear()
        inputs = trainer._generate_and_score_completions([{"prompt": "p"}] * rows)
        generation = {k: float(v[-1]) for k, v in logged.items()}
        for _ in range(config.num_iterations):
            logged.clear()
            loss = 0.0
            for micro in split_tensor_dict(inputs, accumulation):
                micro_loss = trainer._compute_loss(policy, micro)
                micro_loss.backward()
                loss += micro_loss.detach()
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trained)).item()
            opt.step()
            opt.zero_grad()
            metrics = {k: float(v[-1]) for k, v in logged.items()}
            lines.append(json.dumps({"loss": loss.item(), "grad_norm": norm, **generation, **metrics}))
    name = os.path.join(args.out, run["name"])
    save_file({k: v.detach().contiguous() for k, v in policy.state_dict().items()}, name + ".safetensors")
    with open(name + ".jsonl", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--style", default="chatml")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--reward", action="store_true")
    lo = sub.add_parser("lora")
    lo.add_argument("--model", required=True)
    lo.add_argument("--out", required=True)
    lo.add_argument("--config", required=True)
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument("--move-b", action="store_true")
    lo.add_argument("--move-saved", action="store_true")
    d = sub.add_parser("runs")
    d.add_argument("--model", required=True)
    d.add_argument("--runs", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--max-length", type=int, default=1024)
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--steps", type=int, default=10)
    d.add_argument("--lr", type=float, default=1e-3)
    g = sub.add_parser("grpo")
    g.add_argument("--model", required=True)
    g.add_argument("--runs", required=True)
    g.add_argument("--rollouts", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--generations", type=int, required=True)
    g.add_argument("--max-completion-length", type=int, required=True)
    g.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    if args.command == "grpo":
        with open(args.rollouts) as f:
            batches = json.load(f)
        with open(args.runs) as f:
            for run in json.load(f):
                grpo_run(args, run, batches)
        return
    if args.command == "make":
        make(args.style, args.out, args.seed, args.reward)
    elif args.command == "lora":
        lora(args.model, args.out, args.config, args.seed, args.move_b, args.move_saved)
    else:
        with open(args.runs) as f:
            for run in json.load(f):
                trainer_run(args, run)


if __name__ == "__main__":
    command = []
    for word in sys.argv[1:] + ["+"]:
        if word != "+":
            command.append(word)
        elif command:
            main(command)
            command = []
