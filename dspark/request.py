"""A generation request and its per-request speculative state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Status(enum.Enum):
    WAITING = "waiting"      # prompt not (fully) prefilled yet
    RUNNING = "running"      # has an anchor token; drafts and verifies every step
    FINISHED = "finished"


@dataclass(frozen=True)
class DraftBatch:
    """One batched draft pass's results, a row per request in the pass's order."""
    tokens: torch.Tensor                  # [R, γ] int64
    probs: torch.Tensor | None            # [R, γ, V] fp32 draft distributions, or None
    conf_logits: torch.Tensor             # [R, γ] fp32


class DraftBlock:
    """A request's DSpark block: drafted tokens x_1..x_γ [γ] int64, the exact distributions they
    were sampled from [γ, V] fp32 (None: greedy, a point mass on each token) and the confidence
    logits [γ] fp32. Either its own tensors, or row `row` of a `DraftBatch` (`of_batch`): no
    per-request tensor op until a field is asked for, and the blocks of a round whose requests
    are the batch's rows in order stack as a view of the batch (`stack_field`)."""
    __slots__ = ("batch", "row", "_tokens", "_probs", "_conf_logits", "_has_probs")

    def __init__(self, tokens: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                 conf_logits: torch.Tensor | None = None, *, batch: DraftBatch | None = None,
                 row: int = 0, has_probs: bool = True):
        self.batch, self.row = batch, row
        self._tokens, self._probs, self._conf_logits = tokens, probs, conf_logits
        self._has_probs = has_probs and (probs is not None if batch is None
                                         else batch.probs is not None)

    @classmethod
    def of_batch(cls, batch: DraftBatch, greedy) -> list:
        """One block per row of `batch`; rows whose `greedy` flag is set keep no distribution."""
        return [cls(batch=batch, row=i, has_probs=not g) for i, g in enumerate(greedy)]

    @property
    def has_probs(self) -> bool:
        """Whether the block keeps its distributions (`probs` is not None), without making
        its view."""
        return self._has_probs

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = self.batch.tokens[self.row]
        return self._tokens

    @property
    def probs(self) -> torch.Tensor | None:
        if self._probs is None and self._has_probs:
            self._probs = self.batch.probs[self.row]
        return self._probs

    @property
    def conf_logits(self) -> torch.Tensor:
        if self._conf_logits is None:
            self._conf_logits = self.batch.conf_logits[self.row]
        return self._conf_logits


def batch_rows(blocks) -> tuple | None:
    """(DraftBatch, first row) when `blocks` are the rows lo..lo+R-1 of one batch in order (the
    usual round: the requests the pass that drafted them ran for), else None."""
    batch = getattr(blocks[0], "batch", None)       # (blocks may be any object with the fields)
    if batch is None:
        return None
    lo = blocks[0].row
    for i, b in enumerate(blocks):
        if getattr(b, "batch", None) is not batch or b.row != lo + i:
            return None
    return batch, lo


def has_probs(block) -> bool:
    """Whether a block keeps its draft distributions (for a DraftBlock without making its
    view)."""
    return block.has_probs if isinstance(block, DraftBlock) else block.probs is not None


def stack_field(blocks, field: str, width: int | None = None) -> torch.Tensor:
    """[R, ...] the blocks' `field` ("tokens", "probs" or "conf_logits"), its first `width`
    columns: a view of their batch where `batch_rows` finds one, else one stack of their own
    views (every block must have the field: for "probs", has_probs)."""
    rows = batch_rows(blocks)
    if rows is not None:
        out = getattr(rows[0], field)[rows[1]:rows[1] + len(blocks)]
    else:
        out = torch.stack([getattr(b, field) for b in blocks])
    return out if width is None else out[:, :width]


class BlockTokens:
    """The tokens a verify step feeds: the anchor and the first n drafted tokens as a device
    tensor view, so the step can be scheduled without reading the draft tokens back (which would
    wait for the draft pass). The anchor is a host int, or a 0-d device tensor when the previous
    round computed it and the host has not read it yet (the overlapped decode loop). Runners that
    cannot take device tokens call `tolist()` (that read). Made from a request's `DraftBlock`
    (`of_block`), the drafts stay its batch row until asked for, so a step of whole batch rows
    copies them in one slice (`stack_field`)."""
    __slots__ = ("anchor", "_drafts", "block", "n")

    def __init__(self, anchor, drafts: torch.Tensor | None, block: DraftBlock | None = None,
                 n: int | None = None):
        self.anchor = anchor if isinstance(anchor, torch.Tensor) else int(anchor)
        self._drafts, self.block = drafts, block
        self.n = drafts.shape[0] if drafts is not None else n

    @classmethod
    def of_block(cls, anchor, block: DraftBlock, n: int) -> "BlockTokens":
        """The anchor and the first n drafts of `block`."""
        return cls(anchor, None, block, n)

    @property
    def drafts(self) -> torch.Tensor:
        if self._drafts is None:
            self._drafts = self.block.tokens[:self.n]
        return self._drafts

    def __len__(self) -> int:
        return 1 + self.n

    def tolist(self) -> list:
        return [int(self.anchor)] + self.drafts.tolist()


def token_list(tokens) -> list:
    """A host list of token ids from a list or a BlockTokens (the latter reads the device)."""
    return tokens.tolist() if isinstance(tokens, BlockTokens) else tokens


@dataclass
class Request:
    request_id: str
    prompt_ids: list
    params: object                         # SamplingParams
    seed: int
    status: Status = Status.WAITING
    output_ids: list = field(default_factory=list)
    num_prefilled: int = 0                 # prompt tokens whose target KV is written
    finish_reason: str | None = None
    target_state: object = None
    draft_state: object = None
    draft: DraftBlock | None = None
    verify_len: int = 0                    # ℓ chosen by the policy for the next verify
    feed_len: int = 0                      # drafts the next forward carries (>= ℓ: Engine._verify_lengths)
    chunk_feed: int = 0                    # tokens the next prompt chunk feeds (padded: Scheduler)
    metrics: object = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    detok: object = None                   # IncrementalDetokenizer when the model has a tokenizer
    text: str = ""
    preempted: bool = False                # cache was freed; the engine rebuilds draft state
    stop_ids: tuple = ()                   # stop token ids incl. EOS unless ignore_eos
    parent: str = ""                       # the id the caller knows (n > 1: one request per sample)
    index: int = 0                         # which of the parent's n samples
    stop_reason: object = None             # the stop string or stop token id that ended it
    logprobs: list | None = None           # per output token {token id: Logprob} (params.logprobs)
    prompt_logprobs: list | None = None    # per prompt token (None for the first)
    prompt_text: str | None = None         # the prompt as given, when it was a string

    @property
    def tokens(self) -> list:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_ids(self) -> list:
        """Tokens whose target KV a (re)prefill writes: the prompt, or after a preemption every
        committed token (the last output token is the anchor and is fed by the next verify)."""
        return self.prompt_ids + self.output_ids[:-1] if self.output_ids else self.prompt_ids

    @property
    def num_committed(self) -> int:
        """P: positions 0..P-1 have target KV; the anchor (last output token) sits at P."""
        return len(self.prompt_ids) + len(self.output_ids) - 1 if self.output_ids else self.num_prefilled

    @property
    def anchor(self) -> int:
        return self.output_ids[-1]


def sample_seed(seed: int | None, k: int, engine_seed, sample_id: str) -> int:
    """The random seed of sample k of a request: the user's seed + k (vLLM's rule), kept an
    int64; without one, a hash of the engine's seed and the sample's id."""
    if seed is None:
        return hash((engine_seed, sample_id)) & ((1 << 62) - 1)
    seed += k
    return seed - (1 << 64) if seed >= (1 << 63) else seed
