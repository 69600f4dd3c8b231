"""Hugging Face `transformers` reference for Strata's chat-template tests.

  tokenizer  trains a small byte-level BPE tokenizer on sentences made here, with the special
             tokens of a template style (see TEMPLATES), and saves it with the template as a
             tokenizer folder (save_pretrained: tokenizer.json, tokenizer_config.json and
             chat_template.jinja);
  cases      for each STYLE=FILE given, in one process: the tokenizer folder OUT/tok-STYLE,
             and in OUT/render-STYLE.jsonl, for each conversation of the JSON Lines FILE
             ({"messages": [...]}), the text transformers' apply_chat_template renders and
             the ids of that text, with and without the generation prompt after the
             conversation; where transformers refuses a conversation, its message in
             OUT/render-STYLE.error (the conversations before it rendered).

Nothing is downloaded. Run it with the project's virtual environment:
.venv/bin/python scripts/chat_reference.py
"""

import argparse
import json

# Chat templates in the styles of today's families, exercising what such templates use:
# default system prompts, loop variables, namespaces, Python string methods, trimming,
# raised errors and tool turns.
TEMPLATES = {
    "chatml": {
        "special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "template": (
            "{%- if messages[0].role != 'system' %}<|im_start|>system\nYou answer sums.<|im_end|>\n{% endif %}"
            "{%- for message in messages %}"
            "{%- if message.role == 'tool' %}"
            "<|im_start|>user\n<tool_response>\n{{ message.content.strip() }}\n</tool_response><|im_end|>\n"
            "{%- else %}"
            "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
            "{%- endif %}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    },
    # What agents' templates read: tools unless none, reasoning, tool calls beside absent content.
    "tools": {
        "special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "template": (
            "{%- if tools is not none %}<|im_start|>system\nTools: {{ tools | length }}<|im_end|>\n{% endif %}"
            "{%- for message in messages %}"
            "<|im_start|>{{ message.role }}\n"
            "{%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}"
            "{%- if message.thinking is defined %}[{{ message.thinking }}]{% endif %}"
            "{%- if message.content is defined %}{{ message.content }}{% endif %}"
            "{%- if message.tool_calls is defined %}"
            "{%- for call in message.tool_calls %}<call>{{ call.name }}</call>{% endfor %}"
            "{%- endif %}"
            "<|im_end|>\n"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    },
    "headers": {
        "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "template": (
            "{{- bos_token }}"
            "{%- set ns = namespace(turns=0) %}"
            "{%- for message in messages %}"
            "{%- set ns.turns = ns.turns + 1 %}"
            "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
        ),
    },
    "inst": {
        "special": ["<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>",
        "eos": "</s>",
        "template": (
            "{{ bos_token }}"
            "{% for message in messages %}"
            "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
            "{% endif %}"
            "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
            "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
            "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
            "{% endif %}"
            "{% endfor %}"
        ),
    },
    # Every named special token a template may read: the standard ones (bos ... mask), a
    # model's own named in extra_special_tokens (image_token) or as a key of their own
    # (think_token), and cls_token, which this tokenizer lacks.
    "named": {
        "special": ["<s>", "</s>", "<unk>", "<pad>", "<mask>", "<sep>", "<img>", "<think>", "<|im_start|>", "<|im_end|>"],
        "bos": "<s>",
        "eos": "</s>",
        "named": {"unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>", "sep_token": "<sep>",
                  "extra_special_tokens": {"image_token": "<img>"}, "think_token": "<think>"},
        "template": (
            "{{ bos_token }}[{{ unk_token }}|{{ pad_token }}|{{ mask_token }}|{{ sep_token }}|{{ image_token }}"
            "|{{ think_token }}]{% if cls_token is defined %}cls{% else %}no cls{% endif %}\n"
            "{%- for message in messages %}"
            "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ eos_token }}\n"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    },
}


def sentences():
    """Text to learn merges from: sums asked and answered in words and digits."""
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for a in range(10):
        for b in range(10):
            yield f"What is {words[a]} plus {words[b]}? It is {a + b}. The sum of {a} and {b} is {a + b}."


def make_tokenizer(style, out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = TEMPLATES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["special"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"],
                                   **spec.get("named", {}))
    fast.chat_template = spec["template"]
    fast.save_pretrained(out)
    if style == "named":
        # Its image token named in extra_special_tokens, as Gemma 3's tokenizer names its own.
        path = f"{out}/tokenizer_config.json"
        with open(path) as f:
            config = json.load(f)
        config["extra_special_tokens"] = {"image_token": config.pop("image_token")}
        with open(path, "w") as f:
            json.dump(config, f, indent=2)


def render(folder, conversations, rendered):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with open(conversations) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            out = {}
            for key, prompt in (("whole", False), ("prompt", True)):
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                out[key] = {"text": text, "ids": tok(text, add_special_tokens=False)["input_ids"]}
            rendered.write(json.dumps(out) + "\n")


def cases(pairs, out):
    for pair in pairs:
        style, conversations = pair.split("=", 1)
        folder = f"{out}/tok-{style}"
        make_tokenizer(style, folder)
        with open(f"{out}/render-{style}.jsonl", "w") as rendered:
            try:
                render(folder, conversations, rendered)
            except Exception as e:  # the template's own refusal, kept for the caller to compare
                with open(f"{out}/render-{style}.error", "w") as error:
                    error.write(f"{type(e).__name__}: {e}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    make = sub.add_parser("tokenizer")
    make.add_argument("--style", required=True, choices=sorted(TEMPLATES))
    make.add_argument("--out", required=True)
    both = sub.add_parser("cases")
    both.add_argument("--out", required=True)
    both.add_argument("pairs", nargs="+", metavar="STYLE=FILE")
    args = ap.parse_args()
    if args.command == "tokenizer":
        make_tokenizer(args.style, args.out)
    else:
        cases(args.pairs, args.out)


if __name__ == "__main__":
    main()
