"""Tiny configs of the Hugging Face MoE families the HF tests train (4 CPU ranks, ep=2).

Each has 8 routed experts (4 per ep rank, FSDP-sharded over edp=2) and 2 layers, enough to see
every family's own feature: a gated shared expert (Qwen2-MoE), group-limited routing with an fp32
router, shared experts and a dense first layer (DeepSeek-V3), transposed interleaved weights with
biases (gpt-oss). The vocabulary, 97, does not divide by 4 ranks: uneven shards too.
"""

from __future__ import annotations

COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "qwen3_moe": dict(COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=8, norm_topk_prob=True),
    "mixtral": dict(COMMON, intermediate_size=16, num_local_experts=8),
    "olmoe": dict(COMMON, intermediate_size=16, num_experts=8),
    "qwen2_moe": dict(COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_experts=8),
    "deepseek_v3": dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
                        rope_interleave=True),
    "gpt_oss": dict(COMMON, intermediate_size=16, num_local_experts=8, head_dim=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
}
