"""Incremental detokenization for streaming.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and merges can change how the
tail decodes; so decode a short window of recent tokens and emit only text that is final: never a
trailing U+FFFD (an incomplete character that the next token may complete)."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=(), context: int = 6):
        self.tok = tokenizer
        self.ids: list = []
        self.context = context
        self.prefix_offset = 0      # start of the decode window in self.ids
        self.read_offset = 0        # tokens whose text has been emitted

    def push(self, new_ids) -> str:
        """Add tokens, return the newly final text (possibly '')."""
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) < len(prefix) or not full.startswith(prefix):
            return ""               # wait for the rest of the character / a stable merge
        delta = full[len(prefix):]
        self.prefix_offset = max(0, len(self.ids) - self.context)
        # keep prefix_offset <= read_offset so the window always contains the emitted boundary
        self.read_offset = len(self.ids)
        self.prefix_offset = min(self.prefix_offset, self.read_offset)
        return delta

    def flush(self) -> str:
        """Text still held back at the end of generation (e.g. an incomplete character)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return full[len(prefix):] if full.startswith(prefix) else ""
