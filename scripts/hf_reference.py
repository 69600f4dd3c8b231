"""Hugging Face `transformers` reference for Strata's model-folder and generation tests.

Every model is tiny and drawn from a seed here; nothing is downloaded.

  make      builds a random model of a family (see FAMILIES) with a word-level tokenizer and
            saves it with save_pretrained (sharded when --shard-bytes is given); every
            weight of the decoder families is moved off its initial value;
  full-config  prints the whole configuration transformers makes of some config.json keys
            (every key its class defaults written out);
  logits    writes the logits of a folder's model (with a peft adapter folder, if given) for
            given token rows to a safetensors file (with a mixture of experts' folder, its
            load-balancing loss too, as `aux_loss`, padding left out where --mask marks it);
  encoder   writes the logits of a BERT folder's model (classifier or masked language
            model) for token rows with their token types and attention mask, and its loss
            against given labels, to a safetensors file;
  encode-pairs  prints the ids and token types a BERT folder's tokenizer gives texts and
            text pairs (transformers' truncation to a most length, longest first);
  encoder-train  prints the losses of AdamW steps on a BERT folder's model for batches of
            token rows with their token types, attention mask and labels;
            every training command drops out with Strata's masks (see strata_dropout);
  generate  prints the ids transformers' generate(do_sample=False) appends to a prompt;
  generate-bench  times generate(do_sample=False) on a batch of prompts (shorter ones
            padded on the left), the best of some rounds, and prints its seconds and the
            ids it appended;
  seq2seq   writes the logits of a T5 folder's model for padded source rows with their
            attention mask and target labels (-100: none; the decoder's input is the labels
            shifted right), and its loss, to a safetensors file;
  seq2seq-train  prints the losses of AdamW steps on a T5 folder's model for batches of
            {sources, mask, labels};
  seq2seq-generate  prints the ids T5's generate(do_sample=False) writes for a source;
  train     prints the losses of AdamW steps (torch.optim's) on given batches (a mixture of
            experts' with its router_aux_loss_coef times its load-balancing loss): of the whole
            model, or with --adapter of that peft adapter's parameters alone (the adapter
            trained is saved to --save-adapter);
  lora-init saves a peft LoRA adapter of a folder's model, for a JSON LoraConfig, with both
            factors drawn from a seed (init_lora_weights=False), so the adapter changes the
            model from its first step;
  val-loss  prints the mean next-token loss over consecutive windows of a u16 token file,
            batch by batch, as Strata's validation reads them;
  serve     reads one command a line (a JSON list of the arguments above) and answers each
            with one JSON line {"ok", "out", "error"}: the tests keep one process, so
            `transformers` is imported once per test binary instead of once per command.

Run it with the project's virtual environment: .venv/bin/python scripts/hf_reference.py
"""

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

VOCAB = 96
WORDS = 90  # the tokenizer's words; the config's vocabulary is larger, as real models pad it


def tokenizer_json(path):
    """A word-level tokenizer of words w0 .. w{WORDS-1}, split on whitespace."""
    body = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(WORDS)}, "unk_token": "w0"},
    }
    with open(path, "w") as f:
        json.dump(body, f)


def wordpiece_tokenizer_json(path):
    """BERT's tokenizer in small: lower-cased WordPiece over a few words and pieces, with
    [CLS] a [SEP] b [SEP] around texts and their pairs (token types 0, then 1)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = ["the", "a", "play", "movie", "was", "good", "bad", "not", "very", "is", "it", "and", "but",
             "plot", "act", "story", "fun", "dull", ",", ".", "!", "?"]
    pieces = ["##s", "##ing", "##ed", "##ly", "##er", "##y"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate(special + words + pieces + letters + ["##" + c for c in letters])}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.save(path)


def unigram_tokenizer_json(path):
    """T5's tokenizer in small: a Unigram model over pieces that start a word (with the
    metaspace) or continue one, every text ended by </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    special = ["<pad>", "</s>", "<unk>"]
    words = ["the", "a", "play", "movie", "was", "good", "bad", "not", "very", "is", "it", "and", "summar",
             "story", "king", "queen", "said", "short", "long", "text", ":", ".", ",",
             # The opening of A Tale of Two Cities, for the tests' summarization records.
             "best", "of", "times", "worst", "age", "wisdom", "foolishness", "epoch", "belief", "incredulity",
             "season", "light", "darkness", "spring", "hope", "winter", "despair"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = special + ["\u2581" + w for w in words] + ["\u2581"] + letters + ["ize", "s", "ing", "ed", ":", ".", ","]
    assert len(pieces) <= VOCAB
    # Whole words score higher than their letters, so they are kept whole.
    vocab = [(p, 0.0 if i < len(special) else -1.0 - 0.1 * (len(p) == 1)) for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.add_special_tokens(special)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    tok.save(path)


def decoder_families():
    """Tiny configurations of today's decoder families, each with grouped-query attention and
    the options that set it apart: rope scalings, head widths independent of the hidden size,
    query/key norms, Gemma's norms, caps and local layers, Phi-3's fused projections and
    sliding windows shorter than the sequences the tests run."""
    import transformers as tf

    common = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)

    def llama(rope, **kw):
        args = dict(common, num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters=dict(rope, rope_theta=500.0))
        args.update(kw)
        return tf.LlamaForCausalLM, tf.LlamaConfig(**args)

    falcon_h1 = dict(
        common, head_dim=12, num_hidden_layers=2, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=True,
        mamba_norm_before_gate=False, mamba_proj_bias=True, projectors_bias=True, tie_word_embeddings=False,
        embedding_multiplier=2.5, lm_head_multiplier=0.3, key_multiplier=0.7, attention_in_multiplier=1.3,
        attention_out_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.6,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 0.9], mlp_multipliers=[0.7, 1.4],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})

    families = {
        "llama3": lambda: llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "llama-linear": lambda: llama({"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False),
        # Dynamic scaling starts past 8 positions, which every test sequence passes.
        "llama-dynamic": lambda: llama({"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=8),
        "llama-yarn": lambda: llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
        "qwen3": lambda: (tf.Qwen3ForCausalLM, tf.Qwen3Config(
            **common, num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
            use_sliding_window=True, sliding_window=4, max_window_layers=1)),
        "qwen3-tied": lambda: (tf.Qwen3ForCausalLM, tf.Qwen3Config(
            **common, num_hidden_layers=2, head_dim=8, tie_word_embeddings=True)),
        "qwen2-sliding": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(
            **common, num_hidden_layers=3, tie_word_embeddings=False, use_sliding_window=True,
            sliding_window=5, max_window_layers=1)),
        "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(
            **common, num_hidden_layers=2, sliding_window=4, tie_word_embeddings=False)),
        "gemma2": lambda: (tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **common, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True)),
        "gemma3": lambda: (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **dict(common, num_key_value_heads=1), num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            tie_word_embeddings=True)),
        # Mixtures of experts: every expert's weights apart, routing that differs per token,
        # dense layers among sparse ones, and a load-balancing loss that trains the router.
        "mixtral": lambda: (tf.MixtralForCausalLM, tf.MixtralConfig(
            **dict(common, intermediate_size=24), num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=None, tie_word_embeddings=False, router_aux_loss_coef=0.02)),
        "qwen2-moe": lambda: (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            **common, num_hidden_layers=3, moe_intermediate_size=16, shared_expert_intermediate_size=40,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
            tie_word_embeddings=False, router_aux_loss_coef=0.02)),
        "qwen3-moe": lambda: (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, num_hidden_layers=3, head_dim=16, moe_intermediate_size=12, num_experts=16,
            num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[],
            tie_word_embeddings=False, router_aux_loss_coef=0.02)),
        # The router z-loss beside the load-balancing loss (a key Strata reads, which
        # transformers keeps in the config and `train` below adds as Strata computes it).
        "qwen3-moe-z": lambda: (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, num_hidden_layers=3, head_dim=16, moe_intermediate_size=12, num_experts=16,
            num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[],
            tie_word_embeddings=False, router_aux_loss_coef=0.02, router_z_loss_coef=0.05)),
        # Routing that never reaches experts 2 and 3: one expert per token, weight 1 (so the
        # router takes no gradient), router rows [w, -w, 0, 0] (see build); the last layer
        # alone is sparse, so every rank routes what one process routes.
        "qwen3-moe-idle": lambda: (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, num_hidden_layers=2, head_dim=16, moe_intermediate_size=12, num_experts=4,
            num_experts_per_tok=1, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[],
            tie_word_embeddings=False, router_aux_loss_coef=0.0)),
        "olmoe": lambda: (tf.OlmoeForCausalLM, tf.OlmoeConfig(
            **dict(common, intermediate_size=16), num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False, clip_qkv=3.0, tie_word_embeddings=False, router_aux_loss_coef=0.02)),
        # FlexOlmo: OLMo 2's norms after attention and the feed-forward and over whole
        # projections, with OLMoE's experts (six, two per token, unrenormalised).
        "flex-olmo": lambda: (tf.FlexOlmoForCausalLM, tf.FlexOlmoConfig(
            **dict(common, intermediate_size=16), num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=False, tie_word_embeddings=False, router_aux_loss_coef=0.02, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # DeepSeek-V3: latent attention with low-rank queries, interleaved rotated pairs and
        # YaRN's mscale (cos/sin and scores scaled apart); sigmoid routing with a choice
        # bias (drawn in build) among groups, two shared experts, the first layer dense.
        "deepseek-v3": lambda: (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **dict(common, num_key_value_heads=4), num_hidden_layers=3, moe_intermediate_size=12,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=16,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
            tie_word_embeddings=False, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 500.0})),
        # DeepSeek-V2 (V2-Lite's shape): latent attention with whole queries (no low rank),
        # rotated pairs turned as complex numbers, YaRN's mscale; eight experts in four groups,
        # three per token chosen greedily by softmax within the two groups whose best scores
        # are highest (V2's larger models' choice), weighted unrenormalised times the routed
        # scale, beside a shared expert, the first layer dense.
        "deepseek-v2": lambda: (tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config(
            **dict(common, num_key_value_heads=4), num_hidden_layers=3, moe_intermediate_size=12,
            n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=1.5,
            first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            q_lora_rank=None, kv_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 500.0})),
        # GLM-4.7-Flash: DeepSeek-V3's latent attention and routing (a choice bias, drawn in
        # build) in one group, a shared expert, the dense layers named by mlp_layer_types (the
        # first and the last).
        "glm4-moe-lite": lambda: (tf.Glm4MoeLiteForCausalLM, tf.Glm4MoeLiteConfig(
            **dict(common, num_key_value_heads=4), num_hidden_layers=3, moe_intermediate_size=12,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.8,
            mlp_layer_types=["dense", "sparse", "dense"], q_lora_rank=16, kv_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Mistral 4: DeepSeek-V3's latent attention with the queries scaled up past every
        # fourth position, softmax routing among groups without a choice bias, a shared
        # expert, the experts stacked on disk, a dense first layer.
        "mistral4": lambda: (tf.Mistral4ForCausalLM, tf.Mistral4Config(
            **dict(common, num_key_value_heads=4), num_hidden_layers=3, moe_intermediate_size=12,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
            routed_scaling_factor=1.5, first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=16,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "llama_4_scaling_beta": 0.1, "rope_theta": 500.0})),
        # The same with one query projection, rotated halves and no scaling.
        "deepseek-v3-plain": lambda: (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **dict(common, num_key_value_heads=4), num_hidden_layers=2, moe_intermediate_size=12,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            routed_scaling_factor=1.0, first_k_dense_replace=0, norm_topk_prob=False, q_lora_rank=None,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=False,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # GLM-4.5: DeepSeek's routing under grouped-query attention with half-turned heads,
        # query/key norms and biases on the query, key and value projections.
        "glm4-moe": lambda: (tf.Glm4MoeForCausalLM, tf.Glm4MoeConfig(
            **common, num_hidden_layers=3, head_dim=16, moe_intermediate_size=12, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
            first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
            tie_word_embeddings=False)),
        # gpt-oss: attention sinks and biases, sliding and full layers alternating, YaRN
        # without truncation, experts with biases and a SwiGLU clamped low enough to bite,
        # stacked on disk.
        "gpt-oss": lambda: (tf.GptOssForCausalLM, tf.GptOssConfig(
            **dict(common, intermediate_size=32), num_hidden_layers=2, head_dim=8, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.3, tie_word_embeddings=False,
            router_aux_loss_coef=0.02, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 500.0})),
        # Qwen3-Next: Gated DeltaNet linear attention (two key heads serving four value
        # heads) on half the layers, gated full attention with a quarter-turned head on the
        # others, zero-centred norms, experts with a gated shared expert, one layer dense.
        "qwen3-next": lambda: (tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
            **common, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, moe_intermediate_size=12,
            shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False, router_aux_loss_coef=0.02,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
        # OLMo 2: norms after attention and the feed-forward alone, query/key norms over
        # whole projections.
        "olmo2": lambda: (tf.Olmo2ForCausalLM, tf.Olmo2Config(
            **common, num_hidden_layers=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # OLMo 3: OLMo 2's layers, three sliding of every four, YaRN on the full layer and a
        # plain rotation of another base on the sliding ones.
        "olmo3": lambda: (tf.Olmo3ForCausalLM, tf.Olmo3Config(
            **common, num_hidden_layers=4, sliding_window=4, tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 16, "rope_theta": 500.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
        # GLM-4: sandwich norms under GLM's names, a fused gate_up_proj, half of each head
        # turned as adjacent pairs, biases on the query, key and value projections.
        "glm4": lambda: (tf.Glm4ForCausalLM, tf.Glm4Config(
            **common, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False, attention_bias=True, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})),
        # Ministral 3: Mistral's layers under YaRN, queries scaled up past every fourth
        # position (its llama_4_scaling_beta), a window on every layer.
        "ministral3": lambda: (tf.Ministral3ForCausalLM, tf.Ministral3Config(
            **common, num_hidden_layers=2, head_dim=8, sliding_window=6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                             "llama_4_scaling_beta": 0.5, "beta_fast": 32.0, "beta_slow": 1.0,
                             "rope_theta": 500.0})),
        # SmolLM3: the second and fourth layers turn no position (NoPE) and slide.
        "smollm3": lambda: (tf.SmolLM3ForCausalLM, tf.SmolLM3Config(
            **common, num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=4, pad_token_id=0,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Qwen3.5: Qwen3-Next's layers with the linear attention's projections apart (two key
        # heads serving four value heads), a dense feed-forward, a tied head.
        "qwen3.5": lambda: (tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(
            **common, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=True,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
        # Its mixture of experts: every layer sparse beside a gated shared expert, the routing
        # weights always renormalised, no intermediate_size; written as Qwen3.5's releases
        # are, an image model beside the language model (which AutoModelForCausalLM reads).
        "qwen3.5-moe": lambda: (tf.Qwen3_5MoeForConditionalGeneration, tf.Qwen3_5MoeConfig(
            text_config=dict(
                **{k: v for k, v in common.items() if k != "intermediate_size"}, num_hidden_layers=3, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2,
                tie_word_embeddings=False, router_aux_loss_coef=0.02,
                layer_types=["linear_attention", "full_attention", "linear_attention"]),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               patch_size=4, temporal_patch_size=2, spatial_merge_size=2))),
        # Gemma 3 as released: Gemma 3's layers beside an image model (SigLIP) and its
        # projector, the head tied by the outer configuration's default.
        "gemma3-release": lambda: (tf.Gemma3ForConditionalGeneration, tf.Gemma3Config(
            text_config=families["gemma3"]()[1],
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14),
            mm_tokens_per_image=4)),
        # Mistral 3 as released (Mistral Small 3.1): Mistral's layers beside an image model
        # (Pixtral) and its projector, a head of its own and (see without_tie_flag) no tie
        # flag, as releases saved before transformers 5 are.
        "mistral3-release": lambda: (tf.Mistral3ForConditionalGeneration, tf.Mistral3Config(
            text_config=families["mistral"]()[1],
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=8, image_size=28, patch_size=14),
            spatial_merge_size=1, tie_word_embeddings=False)),
        # Qwen3-VL as released: Qwen3's layers (no window) beside an image model whose
        # features also enter early layers (deepstack), the rotation's sections per axis
        # summing to half a head; a head of its own.
        "qwen3-vl-release": lambda: (tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLConfig(
            text_config=dict(common, num_hidden_layers=2, head_dim=16, rope_parameters=dict(
                rope_type="default", rope_theta=500.0, mrope_section=[4, 2, 2], mrope_interleaved=True)),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                               deepstack_visual_indexes=[0]),
            tie_word_embeddings=False)),
        # Qwen2.5-VL as released: Qwen2's layers (biases on the query, key and value
        # projections) beside an image model, the rotation's sections per axis.
        "qwen2.5-vl-release": lambda: (tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig(
            text_config=dict(common, num_hidden_layers=2, rope_parameters=dict(
                rope_type="default", rope_theta=500.0, mrope_section=[2, 1, 1])),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               patch_size=4, temporal_patch_size=2, spatial_merge_size=2, window_size=16,
                               fullatt_block_indexes=[0]),
            tie_word_embeddings=False)),
        # Its mixture of experts as released: experts (stacked input-major in its files) on
        # the layers past the first, their weights always renormalised.
        "qwen3-vl-moe-release": lambda: (tf.Qwen3VLMoeForConditionalGeneration, tf.Qwen3VLMoeConfig(
            text_config=dict(common, num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=12, mlp_only_layers=[0], router_aux_loss_coef=0.02,
                             rope_parameters=dict(rope_type="default", rope_theta=500.0, mrope_section=[4, 2, 2],
                                                  mrope_interleaved=True)),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                               deepstack_visual_indexes=[0]),
            tie_word_embeddings=False)),
        # Mistral Small 4 as released: Mistral 4's text model inside Mistral 3's release.
        "mistral4-release": lambda: (tf.Mistral3ForConditionalGeneration, tf.Mistral3Config(
            text_config=families["mistral4"]()[1],
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=8, image_size=28, patch_size=14),
            spatial_merge_size=1, tie_word_embeddings=False)),
        # EXAONE 4: OLMo 2's norms after attention and the feed-forward alone with per-head
        # query/key norms, every second layer full and turning no position, the others sliding.
        "exaone4": lambda: (tf.Exaone4ForCausalLM, tf.Exaone4Config(
            **common, num_hidden_layers=4, sliding_window=4, sliding_window_pattern=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Seed-OSS: biases on every attention projection, the output's included.
        "seed-oss": lambda: (tf.SeedOssForCausalLM, tf.SeedOssConfig(
            **common, num_hidden_layers=2, head_dim=8, attention_bias=True, attention_out_bias=True,
            attention_dropout=0.0, residual_dropout=0.0, tie_word_embeddings=False)),
        # ERNIE 4.5: each head turned as adjacent pairs, a tied head.
        "ernie4.5": lambda: (tf.Ernie4_5ForCausalLM, tf.Ernie4_5Config(
            **common, num_hidden_layers=2, head_dim=8, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # ERNIE 4.5's mixture of experts (21B-A3B's shape): experts chosen by softmax scores plus
        # a choice bias (drawn in build), weighted by the scores alone, one shared expert, the
        # first layer dense.
        "ernie4.5-moe": lambda: (tf.Ernie4_5_MoeForCausalLM, tf.Ernie4_5_MoeConfig(
            **common, num_hidden_layers=3, head_dim=8, moe_intermediate_size=12, moe_num_experts=4, moe_k=2,
            moe_num_shared_experts=1, moe_layer_start_index=1, router_aux_loss_coef=0.02, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # HunYuan: per-head query/key norms after the rotation, under their own names, and the
        # rotation's base stretched once by its alpha.
        "hunyuan": lambda: (tf.HunYuanDenseV1ForCausalLM, tf.HunYuanDenseV1Config(
            **common, num_hidden_layers=2, head_dim=8, tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "alpha": 4.0, "factor": 1.0, "rope_theta": 500.0})),
        # HunYuan-MoE: HunYuan's attention over every layer's four experts, two per token
        # (given per layer), beside a shared expert, the router and shared expert under their
        # own names.
        "hunyuan-moe": lambda: (tf.HunYuanMoEV1ForCausalLM, tf.HunYuanMoEV1Config(
            **dict(common, intermediate_size=24), num_hidden_layers=2, head_dim=8, num_experts=4,
            moe_topk=[2, 2], tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "alpha": 4.0, "factor": 1.0, "rope_theta": 500.0})),
        # Granite: its embeddings, sub-layer outputs and scores scaled, its logits divided.
        "granite": lambda: (tf.GraniteForCausalLM, tf.GraniteConfig(
            **common, num_hidden_layers=2, embedding_multiplier=3.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Arcee: a feed-forward of ReLU² without a gate, biases on every attention projection,
        # YaRN's rotation.
        "arcee": lambda: (tf.ArceeForCausalLM, tf.ArceeConfig(
            **common, num_hidden_layers=2, tie_word_embeddings=False, attention_bias=True,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "rope_theta": 500.0})),
        # StarCoder2: layer norms with biases, biases on every projection, GELU (tanh) without a
        # gate under c_fc and c_proj, every layer sliding, a tied head, and dropout after the
        # embeddings, of the scores and of each sub-layer's output (Strata's masks, see
        # strata_dropout).
        "starcoder2": lambda: (tf.Starcoder2ForCausalLM, tf.Starcoder2Config(
            **common, num_hidden_layers=2, sliding_window=4, use_bias=True, tie_word_embeddings=True,
            embedding_dropout=0.1, attention_dropout=0.1, residual_dropout=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Nemotron: layer norms with biases scaled by 1 + w, ReLU² without a gate, half of each
        # head turned, biases on the attention and the feed-forward.
        "nemotron": lambda: (tf.NemotronForCausalLM, tf.NemotronConfig(
            **common, num_hidden_layers=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})),
        # Apertus: per-head query/key norms, xIELU without a gate (its learned scales moved and
        # its stored beta and eps drawn below), its norms under their own names.
        "apertus": lambda: (tf.ApertusForCausalLM, tf.ApertusConfig(
            **common, num_hidden_layers=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16, "rope_theta": 500.0})),
        # Llama 4: heads turned as adjacent pairs and normed without a weight on three layers
        # of four, attending within chunks of 4 there; the fourth turning no position, its
        # queries scaled up every 4 positions; every other layer's experts (two of four per
        # token) chosen by sigmoid scores that scale their inputs, beside a shared expert.
        "llama4": lambda: (tf.Llama4ForCausalLM, tf.Llama4TextConfig(
            **dict(common, intermediate_size=16), num_hidden_layers=4, head_dim=8, intermediate_size_mlp=40,
            num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=4,
            floor_scale=4, attn_scale=0.5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16, "rope_theta": 500.0})),
        # Llama 4 as released: its language model beside an image model and its projector,
        # under language_model.
        "llama4-release": lambda: (tf.Llama4ForConditionalGeneration, tf.Llama4Config(
            text_config=families["llama4"]()[1].to_dict(),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=16, patch_size=8, vision_output_dim=16, projector_input_dim=16,
                               projector_output_dim=16, pixel_shuffle_ratio=0.5))),
        # Cohere's Command R: layer norms without a bias, attention and the feed-forward side
        # by side on one norm, heads turned as adjacent pairs, the logits scaled, a tied head.
        "cohere": lambda: (tf.CohereForCausalLM, tf.CohereConfig(
            **common, num_hidden_layers=2, logit_scale=0.25, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Cohere 2 (Command R7B): Cohere's layers, three of four sliding (a window of 4) and
        # turning positions, the fourth attending to all and turning none.
        "cohere2": lambda: (tf.Cohere2ForCausalLM, tf.Cohere2Config(
            **common, num_hidden_layers=4, logit_scale=0.25, sliding_window=4, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # MiniMax-M2: Mixtral's experts and names, four per layer, two per token, chosen by
        # sigmoid scores plus a choice bias (drawn below) and weighted by the renormalised
        # scores; query/key norms over whole projections; half of each head turned, as its
        # folders name it (rotary_dim).
        "minimax-m2": lambda: (tf.MiniMaxM2ForCausalLM, tf.MiniMaxM2Config(
            **dict(common, intermediate_size=24), num_hidden_layers=2, head_dim=8, rotary_dim=4,
            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Granite-MoE: Granite's multipliers over every layer's four experts, two per token,
        # stacked in its files as input_linear and output_linear.
        "granite-moe": lambda: (tf.GraniteMoeForCausalLM, tf.GraniteMoeConfig(
            **dict(common, intermediate_size=24), num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
            embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
            tie_word_embeddings=False, router_aux_loss_coef=0.02,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # LFM2: gated short convolutions (three positions wide, with biases) on three layers of
        # four, attention with per-head query/key norms on the other; the feed-forward's width
        # adjusted by its class (two thirds of 60, rounded up to a multiple of 16: 48).
        "lfm2": lambda: (tf.Lfm2ForCausalLM, tf.Lfm2Config(
            **dict(common, intermediate_size=60), num_hidden_layers=4, block_multiple_of=16, conv_bias=True,
            layer_types=["conv", "full_attention", "conv", "conv"], tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Bamba: Mamba-2 mixers (two groups, chunks of 8) on three layers of four, attention
        # turning half of each head on the other, biases on the mixer's projections.
        "bamba": lambda: (tf.BambaForCausalLM, tf.BambaConfig(
            **common, num_hidden_layers=4, attn_layer_indices=[2], mamba_n_heads=4, mamba_n_groups=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_proj_bias=True,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Falcon-H1 (its larger releases' mixers): on both layers a Mamba-2 mixer (48 wide,
        # four heads in two groups, chunks of 8) beside attention (heads 12 wide), gated then
        # normed, with biases on its projections; every μP multiplier away from one.
        "falcon-h1": lambda: (tf.FalconH1ForCausalLM, tf.FalconH1Config(**falcon_h1)),
        # Falcon-H1 0.5B's mixers, gated without a norm, and a tied head.
        "falcon-h1-ungated": lambda: (tf.FalconH1ForCausalLM, tf.FalconH1Config(
            **dict(falcon_h1, mamba_rms_norm=False, tie_word_embeddings=True))),
        # The class's default order where the mixers have a norm: normed, then gated.
        "falcon-h1-norm-first": lambda: (tf.FalconH1ForCausalLM, tf.FalconH1Config(
            **dict(falcon_h1, mamba_norm_before_gate=True))),
        # Jamba: Mamba-1 mixers (state 8, a step of rank 4) on the even layers, attention
        # turning no position on the odd ones; four experts, two per token, on every other
        # layer from the first, dense networks on the others.
        "jamba": lambda: (tf.JambaForCausalLM, tf.JambaConfig(
            **common, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4, router_aux_loss_coef=0.02,
            use_mamba_kernels=False, tie_word_embeddings=False)),
        # Mamba: two Mamba-1 mixers alone (state 8, a step of rank 4) behind their norms, a
        # tied head; Falcon Mamba's with the step, B and C normed without a weight, a head of
        # its own.
        "mamba": lambda: (tf.MambaForCausalLM, tf.MambaConfig(
            vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
            time_step_rank=4, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)),
        "falcon-mamba": lambda: (tf.FalconMambaForCausalLM, tf.FalconMambaConfig(
            vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
            time_step_rank=4, mixer_rms_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)),
        # LFM2-MoE: LFM2's layers, the first dense (40 wide, as given), the others with four
        # experts, two per token, chosen by sigmoid scores plus a choice bias (drawn in build)
        # and weighted by the renormalised scores times 1.5.
        "lfm2-moe": lambda: (tf.Lfm2MoeForCausalLM, tf.Lfm2MoeConfig(
            **dict(common, intermediate_size=40), num_hidden_layers=4, num_dense_layers=1, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=12, routed_scaling_factor=1.5,
            layer_types=["conv", "full_attention", "conv", "conv"], tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # Granite 4 (its H models): Granite's multipliers, Mamba-2 mixers (four heads in two
        # groups, chunks of 8 positions, so that the test rows span two) on three layers of
        # four and attention turning no position on the other; four experts, two per token,
        # beside every layer's shared_mlp.
        "granite4-hybrid": lambda: (tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(
            **dict(common, intermediate_size=24), num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=20, embedding_multiplier=3.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=False, router_aux_loss_coef=0.02,
            position_embedding_type="nope", layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=8, mamba_conv_bias=True, mamba_proj_bias=False)),
        # Granite 4 without experts (its Micro and Nano models): the shared_mlp alone,
        # attention turning positions, biases on the mixer's projections, the step bounded.
        "granite4-dense": lambda: (tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(
            **common, num_hidden_layers=2, num_local_experts=0, shared_intermediate_size=40,
            embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.25, logits_scaling=2.0,
            tie_word_embeddings=True, position_embedding_type="rope", layer_types=["attention", "mamba"],
            rope_parameters={"rope_type": "default", "rope_theta": 500.0}, mamba_n_heads=8, mamba_n_groups=1,
            mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=8, mamba_proj_bias=True,
            time_step_limit=(0.0, 1.2))),
        # Solar Open: LLaMA's attention with biases on the query, key and value projections
        # alone, eight experts on every layer in two groups, two per token from the best
        # group, sigmoid scores plus a choice bias, renormalised times 1.5, a shared expert.
        "solar-open": lambda: (tf.SolarOpenForCausalLM, tf.SolarOpenConfig(
            **{k: v for k, v in common.items() if k != "intermediate_size"}, head_dim=8, num_hidden_layers=2,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=12, n_group=2,
            topk_group=1, routed_scaling_factor=1.5, attention_bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # dots.llm1: Qwen3's attention sliding (a window of 8) on its last layer, over
        # DeepSeek-V3's routing: eight experts in two groups, two per token from the best
        # group, sigmoid scores plus a choice bias, renormalised times 2, a shared expert, the
        # first layer dense.
        "dots1": lambda: (tf.Dots1ForCausalLM, tf.Dots1Config(
            **common, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=12, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
            norm_topk_prob=True, sliding_window=8, max_window_layers=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
        # OLMo Hybrid as released: OLMo 3's attention (norms after each sub-layer, query/key
        # norms over whole projections) turning no position on one layer of four, Gated
        # DeltaNet on the others (two key heads serving four value heads, betas doubled)
        # normed before each sub-layer as LLaMA's layers are.
        "olmo-hybrid": lambda: (tf.OlmoHybridForCausalLM, tf.OlmoHybridConfig(
            **common, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, pad_token_id=0,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": None}, tie_word_embeddings=False)),
        # Nemotron-H (Nemotron 3 Nano's kinds of layer): each layer one sub-layer behind its
        # norm. Mamba-2 mixers (four heads in two groups, chunks of 8, the step bounded below
        # at 0.01; biases on the projections, drawn large as the others' are, would make every
        # position alike, so there are none, as in its releases) on two layers; attention turning no
        # position on one; a ReLU² feed-forward without a gate on one; and on two, four
        # ReLU² experts in two groups, two per token from the best group, chosen by sigmoid
        # scores plus a choice bias and weighted renormalised times 1.5, beside a shared one;
        # the experts in a latent space of 16 (Nemotron 3 Super's kind).
        "nemotron-h": lambda: (tf.NemotronHForCausalLM, tf.NemotronHConfig(
            **dict(common, head_dim=8),
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
            mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
            use_conv_bias=True, use_bias=False, time_step_min=0.01, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=24, moe_shared_expert_intermediate_size=20, routed_scaling_factor=1.5,
            n_group=2, topk_group=1, moe_latent_size=16, tie_word_embeddings=False)),
        # Gemma 4: norms weighted from one, unscaled scores, values normed per head, global
        # layers with wider heads and one key/value head whose values are the key projection's,
        # turned proportionally (a quarter of each head's pairs, scaled linearly), local layers
        # sliding, the logits capped, each block's output scaled by a stored scalar.
        "gemma4": lambda: (tf.Gemma4ForCausalLM, tf.Gemma4TextConfig(
            **common, num_hidden_layers=4, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1e4, "factor": 2.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            tie_word_embeddings=True)),
        # Gemma 4's mixture of experts (26B-A4B's shape): on every layer four GeGLU experts,
        # two per token, beside the dense feed-forward, its router norming the residual stream
        # and scaling each expert's weight.
        "gemma4-moe": lambda: (tf.Gemma4ForCausalLM, tf.Gemma4TextConfig(
            **common, num_hidden_layers=3, head_dim=8, global_head_dim=16, sliding_window=4,
            hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=12, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=True)),
        # Gemma 4 as released: its language model (here three sliding layers, then a global one
        # with values of its own) beside an image model and its embedder.
        "gemma4-release": lambda: (tf.Gemma4ForConditionalGeneration, tf.Gemma4Config(
            text_config=dict({k: v for k, v in families["gemma4"]()[1].to_dict().items() if k != "per_layer_config"},
                             attention_k_eq_v=False, global_head_dim=16,
                             layer_types=["sliding_attention"] * 3 + ["full_attention"]),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=8, patch_size=4))),
        # Phi-3.5 and Phi-4-mini: LongRoPE's short factors within 16 positions and long ones past
        # them (generation crosses over), on half of each head.
        "phi3-longrope": lambda: (tf.Phi3ForCausalLM, tf.Phi3Config(
            **common, num_hidden_layers=2, original_max_position_embeddings=16, tie_word_embeddings=False,
            rope_parameters={"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 6.0],
                             "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            pad_token_id=0)),
        "phi3": lambda: (tf.Phi3ForCausalLM, tf.Phi3Config(
            **common, num_hidden_layers=2, sliding_window=6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            pad_token_id=0, resid_pdrop=0.1)),
    }
    return families


def build(family, seed):
    import transformers as tf

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB,
                            bos_token_id=1, eos_token_id=2)
        return tf.GPT2LMHeadModel(cfg)
    if family == "llama-bench":
        # Large enough that decoding is the models' work rather than the loop's.
        cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, max_position_embeddings=512, vocab_size=VOCAB,
                             rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        return tf.LlamaForCausalLM(cfg)
    if family == "llama":
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB,
                             rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attention_dropout=0.1)
        return tf.LlamaForCausalLM(cfg)
    if family == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        model = tf.Qwen2ForCausalLM(cfg)
        # Biases start at zero: draw them so that a bias lost on the way shows.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0.0, 0.5)
        return model
    if family in ("bert-classifier", "bert-mlm"):
        common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                      vocab_size=VOCAB, max_position_embeddings=64, type_vocab_size=2, pad_token_id=0)
        if family == "bert-classifier":
            labels = ["negative", "neutral", "positive"]
            cfg = tf.BertConfig(**common, id2label=dict(enumerate(labels)),
                                label2id={name: i for i, name in enumerate(labels)})
            model = tf.BertForSequenceClassification(cfg)
        else:
            model = tf.BertForMaskedLM(tf.BertConfig(**common))
        # Norm weights start at one and biases at zero: move every weight, so that one read
        # or applied wrongly shows in the logits.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        return model
    if family in ("t5", "t5-v11"):
        # v1.0: ReLU and a head tied to the embedding (outputs scaled by 1/sqrt(d_model));
        # v1.1: gated GELU and a head of its own. Two encoder and three decoder layers, an
        # inner attention width unlike d_model, few buckets so that distances reach the
        # logarithmic ones.
        v11 = family == "t5-v11"
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=12, d_ff=48, num_layers=2, num_decoder_layers=3,
                          num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                          feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
                          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        model = tf.T5ForConditionalGeneration(cfg)
        with torch.no_grad():
            if v11:
                # Scaled as v1.0's tied head is, so the logits are of the same size.
                head = model.shared.weight.detach().clone() * cfg.d_model ** -0.5
                model.lm_head.weight = torch.nn.Parameter(head)
                model.config.tie_word_embeddings = False
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        return model
    families = decoder_families()
    if family in families:
        cls, cfg = families[family]()
        model = cls(cfg)
        # Norm weights start at one (or zero) and biases at zero: move every weight, so that
        # one read or applied wrongly shows in the logits.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            # Linear attention and Mamba-2 decay by exp(-A·softplus(a + dt_bias)) per position: with A drawn
            # up to 16 (transformers' initialisation) a head forgets at once and its decay
            # takes a vanishing gradient, which AdamW normalises into a full step decided by
            # rounding. Decays of every head kept alive here.
            for name, p in model.named_parameters():
                if name.endswith("linear_attn.A_log"):
                    p.copy_(torch.empty_like(p).uniform_(0.5, 2.0).log())
                # A Mamba-2 convolution's and projection's biases (and LFM2's projection's)
                # is what a padded position would write into the state: drawn large, and
                # Mamba-2's state kept long, so that writing it shows.
                if name.endswith(("mamba.A_log", "mixer.A_log")):
                    p.copy_(torch.empty_like(p).uniform_(0.05, 0.3).log())
                if name.endswith(("mamba.conv1d.bias", "mamba.in_proj.bias", "conv.in_proj.bias",
                                  "mixer.conv1d.bias", "mixer.in_proj.bias")):
                    p.normal_(0.0, 2.0)
            # The choice bias is a buffer: draw it so that it changes which experts are chosen.
            # Gemma 4's block scalars are buffers too, stored and never trained; ERNIE 4.5 keeps
            # its choice bias as a parameter without a gradient.
            for name, buf in model.named_buffers():
                if name.endswith(("e_score_correction_bias", "feed_forward.expert_bias")):
                    buf.copy_(torch.randn_like(buf) * 0.3)
                if name.endswith("layer_scalar"):
                    buf.uniform_(0.5, 1.5)
                if name.endswith("act_fn.beta"):
                    buf.uniform_(0.3, 0.7)
                if name.endswith("act_fn.eps"):
                    buf.fill_(-0.05)
            for name, p in model.named_parameters():
                if name.endswith("moe_statics.e_score_correction_bias"):
                    p.copy_(torch.randn_like(p) * 0.3)
            # Mistral 4's softmax router over tiny random weights leaves near-ties that rounding
            # flips within ten steps (transformers' own fp32 and fp64 runs part so): sharper
            # routers choose clearly.
            if family.startswith("mistral4"):
                for name, p in model.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        p.mul_(4.0)
            if family == "qwen3-moe-idle":
                for layer in model.model.layers[1::2]:
                    w = layer.mlp.gate.weight
                    w[1] = -w[0]
                    w[2:] = 0.0
        return model
    raise SystemExit(f"unknown family {family}")


def routes_experts(config):
    """Whether a language model's class has a load-balancing loss to return: a mixture of
    experts' (Granite 4's class keeps the key without experts, and fails when asked)."""
    return hasattr(config, "router_aux_loss_coef") and getattr(config, "num_local_experts", 1) != 0


def load(folder):
    import transformers as tf

    # Mistral 3's and Qwen-VL's releases are image-text models only; their text alone is given here. Mistral
    # 4's text model (released inside Mistral 3's) has a class but no auto mapping.
    image_text = tf.AutoModelForImageTextToText
    auto = {"mistral3": image_text, "qwen2_5_vl": image_text, "qwen3_vl": image_text, "qwen3_vl_moe": image_text,
            "mistral4": tf.Mistral4ForCausalLM}.get(
        tf.AutoConfig.from_pretrained(folder).model_type, tf.AutoModelForCausalLM)
    # Eager attention: the composite every family's options (caps, windows) are defined by.
    model = auto.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def load_encoder(folder):
    """A BERT folder's model, as the class its config names (classifier or masked model)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(folder)
    classifier = config.architectures[0] == "BertForSequenceClassification"
    cls = tf.AutoModelForSequenceClassification if classifier else tf.AutoModelForMaskedLM
    return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")


def load_seq2seq(folder):
    import transformers as tf

    return tf.T5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")


def seq2seq_rows(batch):
    return {k: torch.tensor(batch[k], dtype=torch.long) for k in ("sources", "mask", "labels")}


MASK32 = 0xFFFFFFFF
MULTIPLIER = 0x045D9F3B


def mix(x):
    """Strata's 32-bit hash step, on an int or an int64 tensor of 32-bit values."""
    x = ((x ^ (x >> 16)) * MULTIPLIER) & MASK32
    x = ((x ^ (x >> 16)) * MULTIPLIER) & MASK32
    return x ^ (x >> 16)


def fold(h, v):
    return mix((h + v) & MASK32)


def unit_key(seed, step, unit):
    """The key of a unit's masks in a step: the seed's and step's halves, then the unit's
    name (FNV-1a), folded in that order."""
    name = 0x811C9DC5
    for b in unit.encode():
        name = ((name ^ b) * 0x01000193) & MASK32
    key = 0
    for v in (seed & MASK32, seed >> 32, step & MASK32, step >> 32):
        key = fold(key, v)
    return fold(key, name)


def strata_mask(shape, rate, key, site, first_row=0):
    """Which elements Strata drops: each coordinate folded into the site's key, dimension by
    dimension (rows counted from first_row); dropped where the hash is below rate * 2^32."""
    h = torch.tensor(fold(key, site), dtype=torch.int64)
    for d, n in enumerate(shape):
        start = first_row if d == 0 else 0
        view = [n if i == d else 1 for i in range(len(shape))]
        h = mix((h + torch.arange(start, start + n, dtype=torch.int64).view(view)) & MASK32)
    return h < int(rate * 2**32)


def dropout_sites(model):
    """For each module that drops out in training (an nn.Dropout, or an attention module whose
    attention function drops its probabilities), Strata's (unit, site) of each of its calls
    in one forward, in order."""
    sites = {}
    # A peft model's modules are its base model's.
    model = model.get_base_model() if hasattr(model, "get_base_model") else model

    def at(module, *calls):
        sites[id(module)] = list(calls)

    kind = model.config.model_type
    if kind == "gpt2":
        at(model.transformer.drop, ("embedding", 0))
        for i, block in enumerate(model.transformer.h):
            unit = f"transformer.h.{i}"
            at(block.attn, (unit, 0))
            at(block.attn.attn_dropout, (unit, 0))
            at(block.attn.resid_dropout, (unit, 1))
            at(block.mlp.dropout, (unit, 2))
    elif kind == "bert":
        at(model.bert.embeddings.dropout, ("embedding", 0))
        for i, layer in enumerate(model.bert.encoder.layer):
            unit = f"bert.encoder.layer.{i}"
            at(layer.attention.self, (unit, 0))
            at(layer.attention.output.dropout, (unit, 1))
            at(layer.output.dropout, (unit, 2))
        if hasattr(model, "classifier"):
            at(model.dropout, ("head", 0))
    elif hasattr(model, "model") and hasattr(model.model, "layers"):
        # The decoder families drop their attention probabilities, and Phi-3 and StarCoder2
        # each sub-layer's output (StarCoder2's attention the scores first, where it drops
        # them: a zero rate draws nothing), StarCoder2 the embedded tokens too. (Qwen3-Next's
        # linear attention layers drop nothing.)
        starcoder2 = kind == "starcoder2"
        for i, layer in enumerate(model.model.layers):
            unit = f"model.layers.{i}"
            if starcoder2:
                scores = [(unit, 0)] if model.config.attention_dropout > 0 else []
                at(layer.self_attn, *scores, (unit, 1))
                at(layer.mlp, (unit, 2))
            elif hasattr(layer, "self_attn"):
                at(layer.self_attn, (unit, 0))
            if hasattr(layer, "resid_attn_dropout"):
                at(layer.resid_attn_dropout, (unit, 1))
                at(layer.resid_mlp_dropout, (unit, 2))
        if starcoder2:
            at(model.model, ("embedding", 0))
    elif kind == "t5":
        for name, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
            last = f"{name}.block.{len(stack.block) - 1}" if name == "encoder" else "head"
            # The stack's dropout runs twice: on the embedded input, then on the final norm's output.
            at(stack.dropout, (f"{name}.block.0", 0), (last, 7 if name == "encoder" else 0))
            for i, block in enumerate(stack.block):
                unit = f"{name}.block.{i}"
                at(block.layer[0].SelfAttention, (unit, 1))
                at(block.layer[0].dropout, (unit, 2))
                if name == "decoder":
                    at(block.layer[1].EncDecAttention, (unit, 3))
                    at(block.layer[1].dropout, (unit, 4))
                at(block.layer[-1].DenseReluDense.dropout, (unit, 5))
                at(block.layer[-1].dropout, (unit, 6))
    # peft's adapters drop their inputs, each at the site Strata names by the adapted weight,
    # in the unit (the block) that holds it.
    for name, module in model.named_modules():
        drops = getattr(module, "lora_dropout", None)
        block = re.match(r"(.*\.(?:layers|h|block)\.\d+)\.", name)
        if isinstance(drops, torch.nn.ModuleDict) and block:
            for drop in drops.values():
                if isinstance(drop, torch.nn.Dropout):
                    at(drop, (block.group(1), adapter_site(name + ".weight")))
    return sites


def adapter_site(weight):
    """Strata's dropout site of the input of the adapter of the weight named `weight`: bit 30
    beside the low 30 bits of the name's FNV-1a."""
    h = 0x811C9DC5
    for b in weight.encode():
        h = ((h ^ b) * 0x01000193) & MASK32
    return (1 << 30) | (h & ((1 << 30) - 1))


@contextlib.contextmanager
def strata_dropout(model, seed):
    """Within it, the model's dropout draws Strata's masks: torch.nn.functional.dropout is
    replaced by one that asks which module called it (hooks keep a stack of the modules
    running) and drops what Strata's unit and site drop in the same step. Set `.step`
    (counted from 1) before each step's forward."""
    sites = dropout_sites(model)
    running, calls = [], {}
    state = type("DropoutState", (), {"step": 0})()

    def dropped(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        module = running[-1]
        n = calls.get(id(module), 0)
        calls[id(module)] = n + 1
        unit, site = sites[id(module)][n]
        mask = strata_mask(x.shape, p, unit_key(seed, state.step, unit), site)
        return x.masked_fill(mask, 0.0) * (1.0 / (1.0 - p))

    def entered(module, args):
        running.append(module)

    def left(module, args, output):
        running.pop()

    hooks = [model.register_forward_pre_hook(lambda m, a: calls.clear())]
    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(entered))
        hooks.append(m.register_forward_hook(left))
    original = torch.nn.functional.dropout
    torch.nn.functional.dropout = dropped
    try:
        yield state
    finally:
        torch.nn.functional.dropout = original
        for h in hooks:
            h.remove()


def adamw_losses(model, batches_file, lr, loss_of, seed=0):
    """The losses of AdamW steps (torch.optim's, Strata's defaults) on the model's trainable
    parameters, one for each batch of the JSON file, the loss of a batch given by
    loss_of(model, batch); dropout draws Strata's masks from `seed`."""
    model.train()
    with open(batches_file) as f:
        batches = json.load(f)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    with strata_dropout(model, seed) as dropout:
        for step, b in enumerate(batches, start=1):
            dropout.step = step
            loss = loss_of(model, b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def rotation_share_left_out(folder):
    """Drops partial_rotary_factor from the saved rope_parameters, as released MiniMax-M2
    folders give the turned width as rotary_dim alone and Nemotron's may leave it to the
    class's default (half of each head)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_parameters"].pop("partial_rotary_factor", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def without_tie_flag(folder):
    """Drops the outer tie_word_embeddings of an image-text release's config.json, as
    releases saved before transformers 5 hold it: the class's default, tying, then meets
    the stored head, which transformers keeps apart from the embedding."""
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config.pop("tie_word_embeddings", None)
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f, indent=2)


def with_adapter(model, adapter, trainable=False):
    """The model with the peft adapter folder `adapter` loaded, if one is given."""
    if adapter is None:
        return model
    import peft
    return peft.PeftModel.from_pretrained(model, adapter, is_trainable=trainable)


def write_mxfp4(source, quantized, dequantized):
    """Quantizes each expert stack of a gpt-oss folder to MXFP4 as released checkpoints hold
    them (blocks of 32 values, output-major: two E2M1 codes a byte, low nibble first, and an
    E8M0 exponent biased by 127), and writes the folder with them and the folder with
    transformers' own dequantization in their place."""
    import shutil
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    lut = torch.tensor(FP4_VALUES)
    tensors = load_file(f"{source}/model.safetensors")
    plain, packed, unpacked = {}, {}, dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            plain[name] = t
            continue
        rows = t.transpose(1, 2).float()  # [E, R, C], output-major
        e, r, c = rows.shape
        groups = rows.reshape(e, r, c // 32, 32)
        amax = groups.abs().amax(-1).clamp_min(1e-30)
        exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        codes = (groups / torch.exp2(exponent)[..., None])[..., None].sub(lut).abs().argmin(-1).to(torch.uint8)
        blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        scales = (exponent + 127).to(torch.uint8).contiguous()
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        unpacked[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    config = json.load(open(f"{source}/config.json"))
    for out, weights, quantization in ((quantized, {**plain, **packed}, {"quant_method": "mxfp4"}),
                                       (dequantized, unpacked, None)):
        os.makedirs(out, exist_ok=True)
        save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
        cfg = dict(config, quantization_config=quantization) if quantization else config
        with open(f"{out}/config.json", "w") as f:
            json.dump(cfg, f)
        shutil.copy(f"{source}/tokenizer.json", f"{out}/tokenizer.json")


def write_fp8(source, quantized, block):
    """Quantizes a folder's linear layers to fp8 (E4M3) as fine-grained fp8 releases hold them
    (DeepSeek-V3's, Qwen3's, MiniMax-M2's): each `block` x `block` tile of a weight scaled
    so its largest value is E4M3's largest, the tile's float32 `weight_scale_inv` (the factor
    that dequantizes it) beside the weight; `block` 0: one scale per weight, as Mistral's fp8
    releases hold them. Embeddings, norms, routers and the head stay as they are."""
    import shutil
    from safetensors.torch import load_file

    largest = torch.finfo(torch.float8_e4m3fn).max
    out = {}
    for name, t in load_file(f"{source}/model.safetensors").items():
        kept = ("embed" in name or "lm_head" in name or name.endswith(".gate.weight"))
        if kept or not name.endswith(".weight") or t.dim() != 2:
            out[name] = t
            continue
        rows, cols = t.shape
        tile_rows, tile_cols = (block, block) if block else (rows, cols)
        tiles = t.float().reshape(rows // tile_rows, tile_rows, cols // tile_cols, tile_cols)
        scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / largest
        codes = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        out[name] = codes.reshape(rows, cols).contiguous()
        out[name + "_scale_inv"] = (scale if block else scale.reshape(())).contiguous()
    os.makedirs(quantized, exist_ok=True)
    save_file(out, f"{quantized}/model.safetensors", metadata={"format": "pt"})
    for name in os.listdir(source):
        if name.endswith(".json") and name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f"{source}/{name}", f"{quantized}/{name}")
    config = json.load(open(f"{source}/config.json"))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block] if block else None}
    with open(f"{quantized}/config.json", "w") as f:
        json.dump(config, f)


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make")
    make.add_argument("--family", required=True)
    make.add_argument("--out", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--shard-bytes", type=int)
    full = sub.add_parser("full-config")
    full.add_argument("--keys", required=True, help="JSON of config.json keys, model_type among them")
    logits = sub.add_parser("logits")
    logits.add_argument("--dir", required=True)
    logits.add_argument("--tokens", required=True, help="JSON rows of token ids")
    logits.add_argument("--out", required=True)
    logits.add_argument("--adapter")
    logits.add_argument("--mask", help="JSON rows of 1 (token) and 0 (padding), for the load-balancing loss")
    enc = sub.add_parser("encoder")
    enc.add_argument("--dir", required=True)
    enc.add_argument("--tokens", required=True, help="JSON rows of token ids")
    enc.add_argument("--types", required=True, help="JSON rows of token types")
    enc.add_argument("--mask", required=True, help="JSON rows of 1 (token) and 0 (padding)")
    enc.add_argument("--labels", required=True, help="JSON: a label per row, or per position (-100: none)")
    enc.add_argument("--out", required=True)
    pairs = sub.add_parser("encode-pairs")
    pairs.add_argument("--dir", required=True)
    pairs.add_argument("--texts", required=True, help="JSON list of [text, pair or null]")
    pairs.add_argument("--max-length", type=int, required=True)
    enc_train = sub.add_parser("encoder-train")
    enc_train.add_argument("--dir", required=True)
    enc_train.add_argument("--batches", required=True, help="JSON list of {tokens, types, mask, labels}")
    enc_train.add_argument("--lr", type=float, required=True)
    gen = sub.add_parser("generate")
    gen.add_argument("--dir", required=True)
    gen.add_argument("--prompt", required=True, help="JSON list of token ids")
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--config", default="{}", help="JSON of more generate arguments (repetition_penalty)")
    gen_bench = sub.add_parser("generate-bench")
    gen_bench.add_argument("--dir", required=True)
    gen_bench.add_argument("--prompts", required=True, help="JSON rows of token ids, all of one length")
    gen_bench.add_argument("--max-new-tokens", type=int, required=True)
    gen_bench.add_argument("--rounds", type=int, default=3)
    gen_bench.add_argument("--threads", type=int)
    s2s = sub.add_parser("seq2seq")
    s2s.add_argument("--dir", required=True)
    s2s.add_argument("--batch", required=True, help="JSON {sources, mask, labels}")
    s2s.add_argument("--out", required=True)
    s2s_train = sub.add_parser("seq2seq-train")
    s2s_train.add_argument("--dir", required=True)
    s2s_train.add_argument("--batches", required=True, help="JSON list of {sources, mask, labels}")
    s2s_train.add_argument("--lr", type=float, required=True)
    s2s_gen = sub.add_parser("seq2seq-generate")
    s2s_gen.add_argument("--dir", required=True)
    s2s_gen.add_argument("--source", required=True, help="JSON list of token ids")
    s2s_gen.add_argument("--max-new-tokens", type=int, required=True)
    train = sub.add_parser("train")
    train.add_argument("--dir", required=True)
    train.add_argument("--batches", required=True, help="JSON list of [inputs, targets] row lists")
    train.add_argument("--lr", type=float, required=True)
    train.add_argument("--adapter")
    train.add_argument("--save-adapter")
    lora = sub.add_parser("lora-init")
    lora.add_argument("--dir", required=True)
    lora.add_argument("--config", required=True, help="JSON of LoraConfig's fields")
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument("--out", required=True)
    decay = sub.add_parser("decay-skipped", help="the folder's parameter names, and those Trainer leaves "
                           "out of weight decay")
    decay.add_argument("--dir", required=True)
    shaped = sub.add_parser("processors", help="one position's logits through the logits processors "
                            "generate builds for a generation config (left out: null)")
    shaped.add_argument("--dir", required=True)
    shaped.add_argument("--logits", required=True, help="JSON rows of scores")
    shaped.add_argument("--ids", required=True, help="JSON rows of the tokens so far, left-padded")
    shaped.add_argument("--mask", required=True, help="JSON rows of 1 (token) and 0 (padding)")
    shaped.add_argument("--config", required=True, help="JSON generation config fields")
    packing = sub.add_parser("trl-pack", help="TRL's best-fit decreasing packing of examples of these lengths: "
                             "each row's example indices")
    packing.add_argument("--lengths", required=True, help="JSON list of example lengths")
    packing.add_argument("--seq-length", type=int, required=True)
    val = sub.add_parser("val-loss")
    val.add_argument("--dir", required=True)
    val.add_argument("--token-file", required=True)
    val.add_argument("--ctx", type=int, required=True)
    val.add_argument("--batch-size", type=int, required=True)
    val.add_argument("--batches", type=int, required=True)
    quant = sub.add_parser("mxfp4", help="a gpt-oss folder's expert stacks quantized to MXFP4 blocks and "
                           "scales, and the folder of transformers' dequantization of them")
    quant.add_argument("--dir", required=True)
    quant.add_argument("--quantized", required=True)
    quant.add_argument("--dequantized", required=True)
    fp8 = sub.add_parser("fp8", help="a folder's projections quantized to fp8 in square blocks, each "
                         "with its scale, as fine-grained fp8 releases hold them")
    fp8.add_argument("--dir", required=True)
    fp8.add_argument("--quantized", required=True)
    fp8.add_argument("--block", type=int, required=True, help="the tiles' side; 0: one scale per weight")
    sub.add_parser("serve")
    args = ap.parse_args(argv)

    if args.command == "serve":
        serve()
        return

    if args.command == "make":
        model = build(args.family, args.seed)
        kwargs = {"max_shard_size": args.shard_bytes} if args.shard_bytes else {}
        model.save_pretrained(args.out, **kwargs)
        if args.family == "mistral3-release":
            without_tie_flag(args.out)
        if args.family in ("minimax-m2", "nemotron"):
            rotation_share_left_out(args.out)
        if args.family.startswith("bert"):
            wordpiece_tokenizer_json(f"{args.out}/tokenizer.json")
        elif args.family.startswith("t5"):
            unigram_tokenizer_json(f"{args.out}/tokenizer.json")
        else:
            tokenizer_json(f"{args.out}/tokenizer.json")
        print(json.dumps({"folder": args.out}))
    elif args.command == "full-config":
        import transformers as tf
        keys = json.loads(args.keys)
        config = tf.AutoConfig.for_model(keys.pop("model_type"), **keys)
        print(config.to_json_string(use_diff=False))
    elif args.command == "logits":
        model = with_adapter(load(args.dir), args.adapter)
        tokens = torch.tensor(json.loads(args.tokens), dtype=torch.long)
        experts = routes_experts(model.config.get_text_config())
        mask = torch.tensor(json.loads(args.mask), dtype=torch.long) if args.mask else None
        with torch.no_grad():
            out = model(tokens, attention_mask=mask, output_router_logits=True) if experts else model(tokens)
        tensors = {"logits": out.logits.contiguous()}
        # Classes with a loss weight but no load-balancing loss (Llama 4's) give none.
        if experts and getattr(out, "aux_loss", None) is not None:
            tensors["aux_loss"] = out.aux_loss.reshape(1).float()
        save_file(tensors, args.out)
    elif args.command == "encoder":
        model = load_encoder(args.dir)
        model.eval()
        rows = {k: torch.tensor(json.loads(getattr(args, k)), dtype=torch.long) for k in ("tokens", "types", "mask")}
        with torch.no_grad():
            out = model(input_ids=rows["tokens"], token_type_ids=rows["types"], attention_mask=rows["mask"],
                        labels=torch.tensor(json.loads(args.labels), dtype=torch.long))
        save_file({"logits": out.logits.contiguous(), "loss": out.loss.reshape(1)}, args.out)
    elif args.command == "encode-pairs":
        import transformers as tf
        tok = tf.PreTrainedTokenizerFast(tokenizer_file=f"{args.dir}/tokenizer.json")
        out = []
        for a, b in json.loads(args.texts):
            enc = tok(a, b, truncation=True, max_length=args.max_length, return_token_type_ids=True)
            out.append([enc["input_ids"], enc["token_type_ids"]])
        print(json.dumps(out))
    elif args.command == "encoder-train":
        def loss(model, b):
            t = {k: torch.tensor(b[k], dtype=torch.long) for k in ("tokens", "types", "mask", "labels")}
            return model(input_ids=t["tokens"], token_type_ids=t["types"], attention_mask=t["mask"],
                         labels=t["labels"]).loss
        print(json.dumps(adamw_losses(load_encoder(args.dir), args.batches, args.lr, loss)))
    elif args.command == "decay-skipped":
        import transformers as tf
        kind = tf.AutoConfig.from_pretrained(args.dir).model_type
        model = {"t5": load_seq2seq, "bert": load_encoder}.get(kind, load)(args.dir)
        names = [n for n, _ in model.named_parameters()]
        decayed = set(tf.Trainer.get_decay_parameter_names(None, model))
        print(json.dumps({"names": names, "skipped": [n for n in names if n not in decayed]}))
    elif args.command == "trl-pack":
        from datasets import Dataset
        from trl import pack_dataset
        lengths = json.loads(args.lengths)
        # Each example's tokens are its index, so a row's tokens name the examples it holds.
        examples = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
        packed = pack_dataset(examples, args.seq_length, strategy="bfd")
        rows = []
        for ids, seq_lengths in zip(packed["input_ids"], packed["seq_lengths"]):
            starts = np.cumsum([0] + list(seq_lengths))[:-1]
            rows.append([int(ids[s]) for s in starts])
        print(json.dumps(rows))
    elif args.command == "processors":
        import copy
        from transformers.generation import LogitsProcessorList
        model = load(args.dir)
        config = copy.deepcopy(model.generation_config)
        config.update(**json.loads(args.config))
        ids = torch.tensor(json.loads(args.ids), dtype=torch.long)
        mask = torch.tensor(json.loads(args.mask), dtype=torch.long)
        processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
            logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={"attention_mask": mask})
        scores = processors(ids, torch.tensor(json.loads(args.logits), dtype=torch.float32))
        print(json.dumps([[v if math.isfinite(v) else None for v in row] for row in scores.tolist()]))
    elif args.command == "generate":
        model = load(args.dir)
        prompt = torch.tensor([json.loads(args.prompt)], dtype=torch.long)
        # Every token asked for: the end token does not stop it (Strata's test asks for none).
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            out = model.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0, **json.loads(args.config))
        print(json.dumps(out[0, prompt.shape[1]:].tolist()))
    elif args.command == "generate-bench":
        if args.threads:
            torch.set_num_threads(args.threads)
        import transformers as tf
        # transformers' default attention (SDPA), as its users decode.
        model = tf.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
        model.eval()
        model.generation_config.eos_token_id = None
        rows = json.loads(args.prompts)
        # Shorter prompts padded on the left, their padding masked, as batched decoding asks.
        width = max(len(r) for r in rows)
        prompts = torch.tensor([[0] * (width - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompts, do_sample=False, max_new_tokens=args.max_new_tokens,
                                     attention_mask=mask, pad_token_id=0)
            best = min(best, time.perf_counter() - start)
        print(json.dumps({"seconds": best, "tokens": out[:, width:].tolist()}))
    elif args.command == "seq2seq":
        model = load_seq2seq(args.dir)
        model.eval()
        t = seq2seq_rows(json.loads(args.batch))
        with torch.no_grad():
            out = model(input_ids=t["sources"], attention_mask=t["mask"], labels=t["labels"])
        save_file({"logits": out.logits.contiguous(), "loss": out.loss.reshape(1)}, args.out)
    elif args.command == "seq2seq-train":
        def loss(model, b):
            t = seq2seq_rows(b)
            return model(input_ids=t["sources"], attention_mask=t["mask"], labels=t["labels"]).loss
        print(json.dumps(adamw_losses(load_seq2seq(args.dir), args.batches, args.lr, loss)))
    elif args.command == "seq2seq-generate":
        model = load_seq2seq(args.dir)
        model.eval()
        source = torch.tensor([json.loads(args.source)], dtype=torch.long)
        model.generation_config.eos_token_id = None
        # A cache sized by the config's num_layers would be too short for more decoder layers.
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        with torch.no_grad():
            out = model.generate(source, attention_mask=torch.ones_like(source), do_sample=False,
                                 max_new_tokens=args.max_new_tokens, past_key_values=cache)
        # The first id is the decoder's start token.
        print(json.dumps(out[0, 1:].tolist()))
    elif args.command == "lora-init":
        import peft
        torch.manual_seed(args.seed)
        config = peft.LoraConfig(**json.loads(args.config), init_lora_weights=False)
        peft.get_peft_model(load(args.dir), config).save_pretrained(args.out)
    elif args.command == "train":
        model = with_adapter(load(args.dir), args.adapter, trainable=True)

        def loss(model, batch):
            x, y = (torch.tensor(rows) for rows in batch)
            # A mixture of experts trains its routers through the load-balancing loss too.
            # An image-text release's loss weights are its language model's.
            text = model.config.get_text_config()
            experts = routes_experts(text)
            out = model(x, output_router_logits=True) if experts else model(x)
            logits = out.logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            if experts and getattr(out, "aux_loss", None) is not None:
                loss = loss + text.router_aux_loss_coef * out.aux_loss
                # ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)², summed
                # over the sparse layers.
                z = getattr(text, "router_z_loss_coef", 0.0)
                if z:
                    loss = loss + z * sum(torch.logsumexp(l.float(), -1).square().mean() for l in out.router_logits)
            return loss

        losses = adamw_losses(model, args.batches, args.lr, loss)
        if args.save_adapter:
            model.save_pretrained(args.save_adapter)
        print(json.dumps(losses))
    elif args.command == "mxfp4":
        write_mxfp4(args.dir, args.quantized, args.dequantized)
    elif args.command == "fp8":
        write_fp8(args.dir, args.quantized, args.block)
    elif args.command == "val-loss":
        model = load(args.dir)
        tokens = torch.from_numpy(np.fromfile(args.token_file, dtype="<u2").astype(np.int64))
        ctx, rows = args.ctx, args.batch_size
        losses = []
        for b in range(args.batches):
            starts = [(b * rows + r) * ctx for r in range(rows)]
            x = torch.stack([tokens[s:s + ctx] for s in starts])
            y = torch.stack([tokens[s + 1:s + ctx + 1] for s in starts])
            with torch.no_grad():
                logits = model(x).logits
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
        print(json.dumps({"val_loss": sum(losses) / len(losses)}))


def serve():
    """Answers commands from standard input until it closes, one JSON line each."""
    answers = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                main(json.loads(line))
            answer = {"ok": True, "out": printed.getvalue(), "error": ""}
        except BaseException as e:  # argparse exits with SystemExit; report it too
            answer = {"ok": False, "out": printed.getvalue(), "error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
