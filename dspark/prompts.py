"""Prompt inputs at the boundary: what a prompt may be, checked before any work is done.

A prompt is a string, token ids (a list or tuple of ints, or a 1-D integer tensor / array),
{"prompt": str} or {"prompt_token_ids": ids}. Every rejection names the problem (the index and
value of a bad id, the type given) and what is accepted. A string far too long for the model is
rejected from its byte length alone, before tokenizing: a token never stands for more bytes than
the longest entry of the vocabulary, so more than max_model_len times that many bytes cannot fit.
"""
from __future__ import annotations

import numbers

import torch

ACCEPTED = ("a string, token ids (a list / tuple / 1-D tensor of ints), {'prompt': str} or "
            "{'prompt_token_ids': [ints]}")


def is_single(prompts) -> bool:
    """Whether `prompts` is one prompt (else a list of them): a string, a dict, a tensor,
    or a list / tuple whose first element is a number (ids; bad ones are reported by `parse`)."""
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, torch.Tensor) or type(prompts).__module__ == "numpy":
        return True          # one prompt's ids (`token_ids` refuses other shapes)
    if isinstance(prompts, (list, tuple)) and prompts:
        return isinstance(prompts[0], numbers.Number)
    return False


def _is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def max_token_bytes(tokenizer) -> int:
    """Most UTF-8 bytes any vocabulary entry is spelled with (byte-level BPE spells a byte as
    one or two bytes; added tokens count too): an upper bound on the bytes one token covers."""
    cached = getattr(tokenizer, "_dspark_max_token_bytes", None)
    if cached is None:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        cached = max((len(t.encode("utf-8")) for t in vocab), default=1) or 1
        try:
            tokenizer._dspark_max_token_bytes = cached
        except AttributeError:
            pass
    return cached


def token_ids(prompt, vocab_size: int, field: str = "prompt") -> list:
    """Validated ids from a list / tuple / 1-D tensor or array of ints."""
    if isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy":
        dtype = str(prompt.dtype)
        if prompt.ndim != 1:
            raise ValueError(f"{field}: a token-id tensor must be 1-D, got shape "
                             f"{tuple(prompt.shape)}: pass one prompt's ids (a list of prompts "
                             f"for a batch)")
        if "int" not in dtype or "bool" in dtype:
            raise ValueError(f"{field}: a token-id tensor must have an integer dtype, got {dtype}: "
                             f"convert it with .long()")
        prompt = prompt.tolist()
    elif not isinstance(prompt, (list, tuple)):
        raise ValueError(f"{field} must be {ACCEPTED}; got {type(prompt).__name__}")
    for i, t in enumerate(prompt):
        if not _is_id(t):
            raise ValueError(f"{field}[{i}]={t!r} ({type(t).__name__}) is not a token id: token ids "
                             f"are ints in [0, {vocab_size}) (no bools, no floats)")
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError(f"empty prompt: {field} needs at least one token id")
    bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise ValueError(f"prompt token ids {[t for _, t in bad[:5]]} are outside the vocabulary "
                         f"[0, {vocab_size}) (first at {field}[{i}]): use ids of this model's "
                         f"tokenizer")
    return ids


def parse(prompt, tokenizer, vocab_size: int, max_model_len: int | None, path: str = ""):
    """(prompt text or None, validated token ids) of one prompt; ValueError naming the problem."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"}:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise ValueError(f"{{'prompt': ...}} takes a string, got "
                                 f"{type(prompt).__name__}: use {{'prompt_token_ids': ids}} "
                                 f"for token ids")
        elif keys == {"prompt_token_ids"}:
            return None, token_ids(prompt["prompt_token_ids"], vocab_size, "prompt_token_ids")
        else:
            raise ValueError(f"a prompt dict takes exactly one of the keys 'prompt' (a string) or "
                             f"'prompt_token_ids' (ids); got keys {sorted(map(str, keys))}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: pass at least one character or token id")
        if tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json, so string prompts cannot be "
                             f"encoded; pass token-id lists instead")
        if max_model_len is not None:
            limit = max_model_len * max_token_bytes(tokenizer)
            size = len(prompt) if len(prompt) > limit else len(prompt.encode("utf-8"))
            if size > limit:
                raise ValueError(f"prompt is too long: {size} bytes cannot fit in max_model_len="
                                 f"{max_model_len} tokens (a token covers at most "
                                 f"{max_token_bytes(tokenizer)} bytes): shorten the prompt or "
                                 f"raise Engine(max_model_len=...)")
        return prompt, tokenizer.encode(prompt).ids
    return None, token_ids(prompt, vocab_size)


def render_chat(tokenizer, path: str, messages, add_generation_prompt: bool, chat_template,
                template_kwargs: dict) -> tuple:
    """(one conversation?, the rendered prompt text of each) for Engine.chat: `messages` is a
    list of {"role", "content"} dicts or a list of such lists."""
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer.json: chat needs a tokenizer")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                         "dicts (or a list of such lists)")
    single = isinstance(messages[0], dict)
    convs = [messages] if single else list(messages)
    return single, [tokenizer.apply_chat_template(
        c, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
        **template_kwargs) for c in convs]
