"""What the engine hands back: RequestOutput (one per request, vLLM's shape) with one
CompletionOutput per sample, and the text of a sample as it streams (stop strings).

`RequestOutput.outputs[k]` is sample k of a request (SamplingParams.n samples); the flat fields
`token_ids`, `text`, `finish_reason`, `new_token_ids`, `text_delta` repeat outputs[0] (the one
sample when n = 1)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .detok import IncrementalDetokenizer
from .request import Status


@dataclass
class Logprob:
    """A token's log-probability under the target's raw distribution, its rank there (1 = most
    likely) and its text."""
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample. `token_ids` / `text` are cumulative; `new_token_ids` / `text_delta` are what
    the last step added. `stop_reason`: the stop string or stop token id that ended it (None
    for EOS or a length stop). `logprobs`: per token a dict {token id: Logprob} holding the
    chosen token and the k most likely (SamplingParams.logprobs = k), else None."""
    index: int
    text: str | None
    token_ids: list
    finish_reason: str | None = None
    stop_reason: object = None
    logprobs: list | None = None
    new_token_ids: list = field(default_factory=list)
    text_delta: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """State of one request after a step. `token_ids`/`text` are cumulative; `new_token_ids` and
    `text_delta` are what this step added (for streaming); all repeat outputs[0]. `metrics`: the
    DSpark speculation metrics (acceptance, verify lengths, rounds), summed over the samples."""
    request_id: str
    prompt_token_ids: list
    token_ids: list
    text: str | None
    finish_reason: str | None       # "stop" | "length" | "abort" | None while running
    metrics: object
    finished: bool = True
    new_token_ids: list = field(default_factory=list)
    text_delta: str = ""
    outputs: list = field(default_factory=list)
    prompt: str | None = None
    prompt_logprobs: list | None = None

    def __post_init__(self):
        if not self.outputs:        # built from the flat fields (one sample)
            self.outputs = [CompletionOutput(0, self.text, self.token_ids, self.finish_reason,
                                             None, None, self.new_token_ids, self.text_delta)]

    @property
    def stop_reason(self):
        return self.outputs[0].stop_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs


def stop_prefix_len(text: str, stops) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string: text a
    stream must hold back, since the next tokens may complete the stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """The text of one sample: tokens pushed as they are emitted, stop strings found, and the
    part that is final handed out as deltas (`take`). Keeps the `IncrementalDetokenizer`
    invariant: with no stop string hit, every delta joined is `tokenizer.decode(all ids)`."""

    def __init__(self, tokenizer, stop=(), include_stop: bool = False, min_tokens: int = 0):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop, self.include_stop, self.min_tokens = tuple(stop), include_stop, min_tokens
        self.text = ""              # final text so far (truncated at a stop string)
        self.sent = 0               # characters handed out by take()
        self.num_tokens = 0
        self.done = False

    def push(self, ids) -> tuple[int, str | None]:
        """Add emitted tokens; returns (how many of them count, the stop string hit or None).
        With stop strings the tokens go one at a time: the output ends with the token that
        completed the stop string (vLLM's rule), which may be before the end of `ids`."""
        if not self.stop:
            self.text += self.detok.push(ids)
            self.num_tokens += len(ids)
            return len(ids), None
        longest = max(len(s) for s in self.stop)
        for j, t in enumerate(ids):
            start = max(0, len(self.text) - longest + 1)
            self.text += self.detok.push([t])
            self.num_tokens += 1
            if self.num_tokens <= self.min_tokens:
                continue            # no stop before min_tokens (vLLM's rule)
            hit = self._find(start)
            if hit is not None:
                return j + 1, hit
        return len(ids), None

    def _find(self, start: int) -> str | None:
        where = [(self.text.find(s, start), s) for s in self.stop]
        where = [(i, s) for i, s in where if i >= 0]
        if not where:
            return None
        i, s = min(where)
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.done = True
        return s

    def finish(self) -> None:
        """The sample ended: text held back by the detokenizer (an incomplete character) is
        final now."""
        if not self.done:
            start = max(0, len(self.text) - max((len(s) for s in self.stop), default=1) + 1)
            self.text += self.detok.flush()
            if self.stop and self.num_tokens > self.min_tokens:
                self._find(start)
            self.done = True

    def take(self) -> str:
        """Text that became final since the last call; while running, an end of the text that
        may be the start of a stop string is held back."""
        end = len(self.text) if self.done else len(self.text) - stop_prefix_len(
            self.text[self.sent:], self.stop)
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta

    def flush(self) -> str:
        """finish() and take(): everything not handed out yet."""
        self.finish()
        return self.take()


def request_output(group: list, changed, new_tokens: list, delta: str = "",
                   running=()) -> RequestOutput:
    """The RequestOutput of a request from its samples' Requests (`group`); `changed` got
    `new_tokens` and `delta` this step (the other samples' deltas are empty). changed=None: the
    request was aborted; text its samples held back is final now. `running`: samples shown as
    not finished yet (finished in this step, their own output comes after this one: a sample
    never shows finished before its last delta)."""
    outs, running = [], {id(r) for r in running}      # (by identity: Requests compare by value)
    for r in group:
        mine = r is changed
        text = r.text if r.detok is not None else None
        if changed is None and r.detok is not None and r.finish_reason == "abort":
            tail = r.detok.flush()
            r.text += tail
            text, mine, new_tokens, delta = r.text, True, [], tail
        shown = id(r) not in running
        outs.append(CompletionOutput(
            r.index, text, list(r.output_ids), r.finish_reason if shown else None,
            r.stop_reason if shown else None,
            list(r.logprobs) if r.logprobs is not None else None,
            list(new_tokens) if mine else [], delta if mine else ""))
    first, o = group[0], outs[0]
    metrics = first.metrics
    for r in group[1:]:
        metrics = metrics.merge(r.metrics)
    return RequestOutput(first.parent or first.request_id, first.prompt_ids, o.token_ids,
                         o.text, o.finish_reason, metrics,
                         all(r.status == Status.FINISHED and id(r) not in running for r in group),
                         o.new_token_ids, o.text_delta, outs, first.prompt_text,
                         first.prompt_logprobs)
