"""A generation request and its per-request speculative state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Status(enum.Enum):
    WAITING = "waiting"      # prompt not (fully) prefilled yet
    RUNNING = "running"      # has an anchor token; drafts and verifies every step
    FINISHED = "finished"


@dataclass
class DraftBlock:
    tokens: torch.Tensor          # [γ] int64 drafted tokens x_1..x_γ
    probs: torch.Tensor | None    # [γ, V] fp32 exact draft distributions (None when greedy)
    conf_logits: torch.Tensor     # [γ] fp32 confidence logits


class BlockTokens:
    """The tokens a verify step feeds: the anchor and the first ℓ drafted tokens as a device
    tensor view, so the step can be scheduled without reading the draft tokens back (which would
    wait for the draft pass). The anchor is a host int, or a 0-d device tensor when the previous
    round computed it and the host has not read it yet (the overlapped decode loop). Runners that
    cannot take device tokens call `tolist()` (that read)."""
    __slots__ = ("anchor", "drafts")

    def __init__(self, anchor, drafts: torch.Tensor):
        self.anchor = anchor if isinstance(anchor, torch.Tensor) else int(anchor)
        self.drafts = drafts

    def __len__(self) -> int:
        return 1 + self.drafts.shape[0]

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
