"""A draft pass's results as one DraftBatch and its requests' DraftBlocks (dspark/request.py):
the fields of a block are its batch row, and the blocks of a round stack as a view of their
batch when they are its rows in order, else as one stack, with the same values."""
import torch

from dspark.request import (BlockTokens, DraftBatch, DraftBlock, batch_rows, has_probs,
                            stack_field)


def _batch(R=4, g=3, V=7, probs=True):
    gen = torch.Generator().manual_seed(0)
    return DraftBatch(torch.randint(0, V, (R, g), generator=gen),
                      torch.rand(R, g, V, generator=gen) if probs else None,
                      torch.randn(R, g, generator=gen))


def test_blocks_are_their_batch_rows():
    b = _batch()
    blocks = DraftBlock.of_batch(b, [False, True, False, True])
    for i, blk in enumerate(blocks):
        assert torch.equal(blk.tokens, b.tokens[i]) and torch.equal(blk.conf_logits, b.conf_logits[i])
    # greedy rows keep no distribution; the others their batch row
    assert [has_probs(x) for x in blocks] == [True, False, True, False]
    assert blocks[1].probs is None and torch.equal(blocks[2].probs, b.probs[2])
    assert all(not x.has_probs for x in DraftBlock.of_batch(_batch(probs=False), [False] * 4))
    # a block of its own tensors (no batch)
    own = DraftBlock(torch.tensor([1, 2, 3]), None, torch.zeros(3))
    assert own.batch is None and not own.has_probs and own.tokens.tolist() == [1, 2, 3]


def test_stack_field_is_a_view_of_rows_in_order_else_a_stack():
    b = _batch()
    blocks = DraftBlock.of_batch(b, [False] * 4)
    for field in ("tokens", "probs", "conf_logits"):
        whole = stack_field(blocks, field)
        assert whole.data_ptr() == getattr(b, field).data_ptr()          # no copy
        assert torch.equal(whole, getattr(b, field))
        mid = stack_field(blocks[1:3], field)                             # rows 1, 2: a slice
        assert torch.equal(mid, getattr(b, field)[1:3])
        assert mid.data_ptr() == getattr(b, field)[1].data_ptr()
    assert batch_rows(blocks[1:3]) == (b, 1)
    # out of order, a gap, or blocks of two batches: stacked, the same values
    for sel in ([2, 0], [0, 2], [3, 2, 1, 0]):
        picked = [blocks[i] for i in sel]
        assert batch_rows(picked) is None
        got = stack_field(picked, "tokens")
        assert got.data_ptr() != b.tokens.data_ptr() and torch.equal(got, b.tokens[sel])
    other = DraftBlock.of_batch(_batch(), [False] * 4)
    assert batch_rows([blocks[0], other[1]]) is None
    mixed = stack_field([blocks[0], other[1]], "conf_logits")
    assert torch.equal(mixed[1], other[1].conf_logits)
    # the first `width` columns
    assert torch.equal(stack_field(blocks, "tokens", 2), b.tokens[:, :2])
    assert torch.equal(stack_field([blocks[3], blocks[0]], "tokens", 2), b.tokens[[3, 0], :2])


def test_block_tokens_of_a_block():
    b = _batch()
    blk = DraftBlock.of_batch(b, [True] * 4)[2]
    t = BlockTokens.of_block(5, blk, 2)
    assert len(t) == 3 and t.n == 2 and t.block is blk
    assert t.tolist() == [5] + b.tokens[2, :2].tolist()
    plain = BlockTokens(torch.tensor(4), torch.tensor([7, 8]))
    assert plain.block is None and len(plain) == 3 and plain.tolist() == [4, 7, 8]
