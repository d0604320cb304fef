"""Bytes one GPU holds: its share of the weights and its KV per token.

Contract: pure functions of a `ModelSpec`, a TP size and a stage's layer count. Sharding follows vLLM's
parallel layers: q, o, the MLP and the vocabulary are split TP ways; norms are replicated; k and v are split
while TP <= KV heads and replicated, one head per rank, once TP exceeds them.
"""

from __future__ import annotations

from ringsched.capacity.presets import ModelSpec


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads one TP rank stores. Past TP = h_kv every rank keeps a replicated head (the h_kv wall)."""
    return max(1, model.num_kv_heads // tp)


def layer_params_per_rank(model: ModelSpec, tp: int) -> float:
    """Parameters of one decoder layer held by one TP rank."""
    d, hd = model.hidden_size, model.head_dim
    q_heads = model.num_heads / tp
    kv = kv_heads_per_rank(model, tp)
    attn = d * q_heads * hd + 2 * d * kv * hd + q_heads * hd * d  # q, k, v, o
    if model.qkv_bias:
        attn += (q_heads + 2 * kv) * hd
    mlp = 3 * d * model.intermediate_size / tp  # gate, up, down
    norms = 2 * d + (2 * hd if model.qk_norm else 0)  # replicated on every rank
    return attn + mlp + norms


def stage_weight_bytes(model: ModelSpec, tp: int, layers: int, *, first: bool, last: bool) -> float:
    """Weight bytes on one GPU of a stage: its layers, the embedding if first, norm and lm_head if last."""
    vocab_shard = model.vocab_size * model.hidden_size / tp
    params = layers * layer_params_per_rank(model, tp)
    if first:
        params += vocab_shard
    if last:
        params += model.hidden_size  # final norm
        # A tied lm_head reuses the embedding only where one stage holds both; with PP > 1 the last stage
        # loads its own copy, as vLLM and SGLang do.
        if not model.tie_embeddings or not first:
            params += vocab_shard
    return params * model.dtype_bytes


def stage_read_bytes(model: ModelSpec, tp: int, layers: int, *, first: bool, last: bool) -> float:
    """Weight bytes one GPU of a stage reads from HBM per forward pass.

    Everything it holds except the embedding table, of which a step gathers only T rows; a tied table is the
    lm_head too where one stage holds both, and then it is read in full.
    """
    held = stage_weight_bytes(model, tp, layers, first=first, last=last)
    if first and not (model.tie_embeddings and last):
        held -= model.vocab_size * model.hidden_size / tp * model.dtype_bytes
    return held


def total_weight_bytes(model: ModelSpec) -> float:
    """The whole model on one GPU: 131.4 GiB for Llama-3-70B in bf16 (untied embedding and lm_head)."""
    return stage_weight_bytes(model, 1, model.num_layers, first=True, last=True)


def kv_bytes_per_token_per_layer(model: ModelSpec, tp: int = 1) -> int:
    """K and V of one token in one layer on one rank: 2 * h_kv * d_h * b at TP=1 (4 KiB for Llama-3-70B)."""
    return 2 * kv_heads_per_rank(model, tp) * model.head_dim * model.dtype_bytes


def kv_bytes_per_token(model: ModelSpec, tp: int, layers: int) -> int:
    """KV bytes per token on one GPU of a stage: only its own layers' KV lives there."""
    return layers * kv_bytes_per_token_per_layer(model, tp)
