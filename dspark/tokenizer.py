"""The checkpoint's tokenizer as HF users know it: tokenizer.json (the `tokenizers` model) plus
tokenizer_config.json (special tokens, eos, chat template).

`apply_chat_template` renders the template the way transformers' `apply_chat_template` does:
jinja2's sandboxed environment with trim_blocks and lstrip_blocks, the loop-controls extension,
a `tojson` filter that does not escape HTML, `raise_exception`, `strftime_now`, and the named
special tokens (bos_token, eos_token, ...) as template variables; messages' keys whose value is
None are dropped. The template is tokenizer_config.json's `chat_template` (a string, or a list of
{name, template} where "default" is taken), else a chat_template.jinja file next to it.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _content(tok):
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """A `tokenizers.Tokenizer` (every attribute of it is reachable here: encode, decode,
    get_vocab, ...) plus what tokenizer_config.json adds."""

    def __init__(self, tok, config: dict | None = None, chat_template: str | None = None):
        self._tok = tok
        self.config = dict(config or {})
        self.special_tokens_map = {name: _content(self.config[name]) for name in SPECIAL_NAMES
                                   if _content(self.config.get(name)) is not None}
        self.chat_template = chat_template
        for name in SPECIAL_NAMES:
            text = self.special_tokens_map.get(name)
            setattr(self, name, text)
            setattr(self, name + "_id", tok.token_to_id(text) if text is not None else None)

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer | None":
        fn = os.path.join(path, "tokenizer.json")
        if not os.path.exists(fn):
            return None
        from tokenizers import Tokenizer as HFTokenizer
        config, template = {}, None
        cfg_fn = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_fn):
            try:
                with open(cfg_fn, encoding="utf-8") as f:
                    config = json.load(f)
            except ValueError as e:
                raise ValueError(f"{cfg_fn} is not valid JSON ({e}): fix or remove the file") from None
            template = config.get("chat_template")
            if isinstance(template, list):      # named templates: the "default" one
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
        jinja_fn = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_fn):
            with open(jinja_fn, encoding="utf-8") as f:
                template = f.read()
        return cls(HFTokenizer.from_file(fn), config, template)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text: str, add_special_tokens: bool = True):
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # special tokens (bos, eos, ...) are left out of text by default, as `tokenizers` and
        # vLLM do
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False,
                            tokenize: bool = False, chat_template: str | None = None,
                            tools=None, documents=None, **kwargs):
        """The conversation as the template renders it (a string), or its token ids with
        tokenize=True (no special tokens added: the template writes them)."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template: add a 'chat_template' to "
                             "tokenizer_config.json (or a chat_template.jinja file), or pass "
                             "chat_template=...")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                             "dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}]={m!r}: each message is a dict with 'role' and "
                                 f"'content'")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = compile_template(template).render(
            messages=chat, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False).ids if tokenize else text


_compiled: dict = {}


def compile_template(template: str):
    """A jinja2 template in the environment transformers renders chat templates in."""
    got = _compiled.get(template)
    if got is not None:
        return got
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'dspark[serve]' "
                          "(or pip install jinja2)") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        got = env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message}): fix "
                         f"'chat_template' in tokenizer_config.json") from None
    _compiled[template] = got
    return got
