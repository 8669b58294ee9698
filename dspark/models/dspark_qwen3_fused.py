"""The DeepSpec (Qwen3) drafter's batched block forward and context write on fused kernels: what
`Qwen3DSparkDrafter.block_hidden_batched` / `commit_rows` compute, in 9 launches per draft layer
instead of ~65 (a CUDA-graphed draft pass at batch 1 is bound by its launch count).

Per layer: stacked q|k|v GEMM, q/k norm + RoPE, attention over context + block, o GEMM, residual
add + post norm, stacked gate|up GEMM, SwiGLU, down GEMM, residual add + the next norm (the next
layer's input norm, or the final norm after the last layer). Per pass: one launch builds the
block's embeddings and positions, one the first input norm. Context write: fc GEMM, hidden norm,
then per layer the k|v GEMM and one launch that norms, rotates and stores both into the pool.

The stacked projections are the modules' own weights: `stack_projections` moves q/k/v (and
gate/up) of a layer into one tensor and leaves each module's weight a view of it, so nothing is
duplicated and the torch path keeps working on the same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import qwen3_draft as kq
from ..kernels.gqa_draft_attention import gqa_draft_attention
from ..kernels.qwen3_norm import rms_norm


def fusable(drafter) -> bool:
    """Whether the fused forward applies: projections without biases (Qwen3's)."""
    return all(m.bias is None for layer in drafter.layers
               for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj))


def _views_of(stack: torch.Tensor, mods) -> bool:
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        if m.weight.data_ptr() != stack[off:off + n].data_ptr() or m.weight.shape != stack[off:off + n].shape:
            return False
        off += n
    return off == stack.shape[0]


def stacked(mods) -> torch.Tensor:
    """One [Σ out, in] weight whose row blocks are the modules' weights (each module's weight
    becomes a view of it on the first call; later calls return the same tensor)."""
    stack = getattr(mods[0], "_stacked_weight", None)
    if stack is not None and _views_of(stack, mods):
        return stack
    with torch.inference_mode(False), torch.no_grad():
        stack = torch.cat([m.weight.detach() for m in mods])
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(stack[off:off + n], requires_grad=m.weight.requires_grad)
            off += n
    mods[0]._stacked_weight = stack
    return stack


def stack_projections(drafter) -> None:
    """Stack every layer's q|k|v and gate|up weights now (not inside a graph capture)."""
    for layer in drafter.layers:
        a, mlp = layer.self_attn, layer.mlp
        stacked((a.q_proj, a.k_proj, a.v_proj))
        stacked((mlp.gate_proj, mlp.up_proj))


def _inv_freq(drafter, device) -> torch.Tensor:
    cached = getattr(drafter, "_rope_inv_freq", None)
    if cached is None or cached.device != device:
        a = drafter.layers[0].self_attn
        cached = kq.rope_inv_freq(a.head_dim, a.theta, device)
        drafter._rope_inv_freq = cached
    return cached


def block_hidden_fused(drafter, embed: nn.Embedding, anchors: torch.Tensor, starts: torch.Tensor,
                       slots: torch.Tensor, pool) -> torch.Tensor:
    """`block_hidden_batched` (every start <= pool rows): post-norm hidden [R, γ, H]."""
    R, g = anchors.shape[0], drafter.gamma
    table = (drafter.embed_tokens or embed).weight
    h, pos = kq.block_embed(table, anchors, starts, g, drafter.cfg.mask_token_id)
    inv = _inv_freq(drafter, h.device)
    layers = drafter.layers
    first = layers[0].input_layernorm
    x = rms_norm(h, first.weight, first.eps)
    for j, layer in enumerate(layers):
        a, mlp = layer.self_attn, layer.mlp
        qkv = F.linear(x, stacked((a.q_proj, a.k_proj, a.v_proj)))
        q, k = kq.qk_norm_rope(qkv, pos, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, inv,
                               a.nq, a.nkv)
        v = qkv[:, (a.nq + a.nkv) * a.head_dim:].view(-1, a.nkv, a.head_dim)
        o = gqa_draft_attention(q, pool.k[j], pool.v[j], slots, starts, k, v)
        post = layer.post_attention_layernorm
        h, x = kq.add_rms_norm(h, a.o_proj(o.view(o.shape[0], -1)), post.weight, post.eps)
        m = kq.silu_mul(F.linear(x, stacked((mlp.gate_proj, mlp.up_proj))))
        nxt = layers[j + 1].input_layernorm if j + 1 < len(layers) else drafter.norm
        h, x = kq.add_rms_norm(h, mlp.down_proj(m), nxt.weight, nxt.eps)
    return x.view(R, g, -1)


def commit_rows_fused(drafter, pool, slots: torch.Tensor, taps: torch.Tensor,
                      positions: torch.Tensor) -> None:
    """`commit_rows`: context K/V of every draft layer for rows (slots[i], positions[i])."""
    hn = drafter.hidden_norm
    c = rms_norm(drafter.fc(taps.to(drafter.fc.weight.dtype)), hn.weight, hn.eps)
    inv = _inv_freq(drafter, c.device)
    for j, layer in enumerate(drafter.layers):
        a = layer.self_attn
        w = stacked((a.q_proj, a.k_proj, a.v_proj))[a.nq * a.head_dim:]     # k|v rows
        kq.kv_norm_rope_to_pool(F.linear(c, w), slots, positions, a.k_norm.weight, a.k_norm.eps,
                                inv, pool.k[j], pool.v[j])
