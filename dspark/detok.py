"""Incremental detokenization for streaming.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and merges can change how the
tail decodes; so decode a short window of recent tokens and emit only text that is final: never a
trailing U+FFFD (an incomplete character that the next token may complete).

Invariant: the concatenation of every `push` result followed by `flush` equals
`tokenizer.decode(all ids)`, whatever the chunking of the ids.

State: tokens ``[prefix_offset, read_offset)`` form a window whose decode (`_prefix_text`) ends
on a character boundary and has been emitted in full; `_extra` is text emitted beyond that
boundary (complete characters decoded before a still-incomplete tail), so text reaches the caller
as soon as it is final even when the same step also produced the first bytes of the next
character."""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=(), context: int = 6):
        # prompt_ids is accepted for API compatibility; the text is the decode of the output ids
        # alone (what `tokenizer.decode(output_ids)` returns), so the prompt is not needed.
        self.tok = tokenizer
        self.ids: list = []
        self.context = max(1, int(context))
        self.prefix_offset = 0      # start of the decode window in self.ids
        self.read_offset = 0        # tokens whose text has been emitted (up to a char boundary)
        self._prefix_text = ""      # decode(ids[prefix_offset:read_offset])
        self._extra = ""            # emitted text past read_offset (complete chars before a tail)

    def _decode(self, ids) -> str:
        return self.tok.decode(list(ids)) if ids else ""

    def push(self, new_ids) -> str:
        """Add tokens, return the newly final text (possibly '')."""
        self.ids.extend(map(int, new_ids))
        if len(self.ids) == self.read_offset:
            return ""
        full = self._decode(self.ids[self.prefix_offset:])
        known = self._prefix_text + self._extra
        if not full.startswith(known):
            return ""               # the tail decodes inconsistently for now: wait for more tokens
        stable = full.rstrip(REPLACEMENT)
        delta = stable[len(known):]
        if len(stable) == len(full):
            # everything decodes to complete characters: move the boundary to the end and keep
            # only the last `context` tokens as the window (a window starting mid-character
            # decodes its head identically in both decodes, so differences stay exact)
            self.read_offset = len(self.ids)
            self.prefix_offset = max(0, self.read_offset - self.context)
            self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self._extra = ""
        else:
            self._extra += delta     # trailing U+FFFD held back; text before it is final
        return delta

    def flush(self) -> str:
        """Text still held back at the end of generation (e.g. an incomplete character, which
        then decodes to U+FFFD exactly as `tokenizer.decode` would)."""
        full = self._decode(self.ids[self.prefix_offset:])
        known = self._prefix_text + self._extra
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.context)
        self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        self._extra = ""
        return full[len(known):] if full.startswith(known) else ""
