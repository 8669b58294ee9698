"""DeepSeek-V4 attention on the paged cache: the ``attn_fn`` hook of ``Block.forward``.

Same math and the same order as ``Attention.forward`` (the dense reference), with the state
reads/writes going through an AttentionBackend: window kv -> main compressor rows and entries ->
indexer compressor rows and keys -> indexer top-k -> sparse attention -> output projection.
Everything that is model math (projections, pooling, entry post-processing, index queries,
output) is the model's own code; the backend only stores, selects and attends.
"""
from __future__ import annotations

import torch

from dspark.formats.layouts import INDEXER_DIM, fp4_roundtrip, hadamard128


class RecordQuant:
    """Model-side rounding with an fp8 record cache. The fp8_ds_mla record itself performs the
    FP8 rounding of window kv and compressed entries on write (so ``kv`` is the identity here);
    indexer queries and keys still get the reference's Hadamard + FP4 fake-quant (§3.5, §3.6),
    as QuantSim does on the dense path, before the keys go into the 132-B FP8 rows."""

    def kv(self, x):
        return x

    def indexer(self, x):
        from dspark.models.deepseek_v4.norm import fused_backend
        if x.shape[-1] == INDEXER_DIM and fused_backend(x):   # one Triton launch, not ~29
            from dspark.kernels.decode_fused import hadamard_fp4
            return hadamard_fp4(x)
        return fp4_roundtrip(hadamard128(x.float()))


def make_attn_fn(backend, md):
    """attn_fn(attn, x, batch, layer_id, quant) for one planned forward. The model's ``quant``
    argument is ignored: the cache format decides the rounding (RecordQuant or none)."""
    quant = RecordQuant() if backend.cache.fp8 else None

    def attn_fn(attn, x, batch, layer_id, _model_quant=None):
        return paged_attention(attn, x, backend, md, layer_id, quant)
    return attn_fn


def paged_attention(attn, x, be, md, layer: int, quant):
    """x [T, D] (attn-normed hidden of the flat batch) -> attention output [T, D]."""
    pos, bound, memo = md.positions, md.position_bound, md.rope_memo
    cq, q, kv = attn.project_q_kv(x, pos, quant, bound, memo)
    be.write_window(md, layer, kv)
    selected = None
    if attn.ratio:
        _emit(attn, attn.compressor, be, md, layer, "main", x, quant)
    if attn.ratio == 4:
        _emit(attn, attn.indexer.compressor, be, md, layer, "indexer", x, quant)
        qi, wi = attn.indexer.queries(x, cq, pos, attn.rope, quant, bound, memo)
        selected = be.select(md, layer, qi, wi, attn.indexer.topk)
    o = be.attend(md, layer, q, attn.attn_sink, attn.head_dim ** -0.5, selected)
    return attn.output(o, pos, x.dtype, bound, memo)


def _emit(attn, comp, be, md, layer, kind, x, quant):
    """Compressor rows of every token; pool and store the entries completed in this forward."""
    a, z = comp.rows(x, md.positions)
    wins = be.write_compressor_rows(md, layer, kind, a, z)
    if wins:
        ents = [attn.finish_entries(comp.pool(w.a, w.z, w.j0 - w.jb, w.j1 - w.jb), w.j0, comp,
                                    x.dtype, quant, indexer=kind == "indexer") for w in wins]
        be.write_entries(md, layer, kind, torch.cat(ents))
