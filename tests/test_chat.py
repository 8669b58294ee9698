"""Chat templates render as transformers' apply_chat_template renders them (same tokenizer files),
the tokenizer carries tokenizer_config.json's special tokens, and Engine.chat."""
import json
import os
import shutil

import pytest

from dspark import Engine, SamplingParams
from dspark.engine import default_model_path
from dspark.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "Write fib."}],
    [{"role": "system", "content": "You write Python.\nKeep it short."},
     {"role": "user", "content": "fib"}, {"role": "assistant", "content": "def fib(n):"},
     {"role": "user", "content": "naïve “quotes” 😀 <b>&</b>"}],
    [{"role": "user", "content": "tools?", "name": None}],
]

# DeepSeek-style: role markers as added special tokens, bos/eos as AddedToken dicts in the
# config, a namespace carried through the loop, loop controls, tojson on tool schemas, and
# raise_exception for an unknown role
DEEPSEEK_STYLE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% if tools %}\n## Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{%- else %}{{ raise_exception('unknown role ' + message['role']) }}{%- endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds_tok")
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HF
    tok = HF.from_file(os.path.join(default_model_path(), "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<｜begin▁of▁sentence｜>", special=True),
                            AddedToken("<｜end▁of▁sentence｜>", special=True),
                            AddedToken("<｜User｜>", special=True),
                            AddedToken("<｜Assistant｜>", special=True)])
    tok.save(str(d / "tokenizer.json"))
    added = lambda s: {"__type": "AddedToken", "content": s, "lstrip": False,  # noqa: E731
                       "normalized": False, "rstrip": False, "single_word": False}
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                   "bos_token": added("<｜begin▁of▁sentence｜>"),
                   "eos_token": added("<｜end▁of▁sentence｜>"), "chat_template": DEEPSEEK_STYLE}, f)
    return str(d)


@pytest.fixture(scope="module")
def shipped_dir(tmp_path_factory):
    """The shipped tokenizer files alone (transformers would read the model's config.json too)."""
    d = tmp_path_factory.mktemp("shipped_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path(), name), d / name)
    return str(d)


@pytest.mark.parametrize("which", ["shipped_dir", "deepseek_dir"])
def test_template_matches_transformers(which, request):
    path = request.getfixturevalue(which)
    ours = Tokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "<x>"}}}]
    for conv in CONVERSATIONS:
        for gen in (False, True):
            want = theirs.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False,
                                              tools=tools)
            got = ours.apply_chat_template(conv, add_generation_prompt=gen, tools=tools)
            assert got == want
            assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True,
                                            tools=tools) == theirs.apply_chat_template(
                conv, add_generation_prompt=gen, tokenize=True, tools=tools, return_dict=False)
    assert ours.eos_token == theirs.eos_token and ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.encode("def f(x):").ids == theirs.encode("def f(x):")


def test_template_errors_name_the_fix(deepseek_dir, tmp_path):
    ours = Tokenizer.from_dir(deepseek_dir)
    with pytest.raises(Exception, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty list"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\].*'role'"):
        ours.apply_chat_template(["hi"])
    shutil.copy(os.path.join(deepseek_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    bare = Tokenizer.from_dir(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template: add a 'chat_template'"):
        bare.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="does not parse"):
        bare.apply_chat_template(CONVERSATIONS[0], chat_template="{% for %}")


def test_engine_chat():
    eng = Engine(device="cpu", max_model_len=256)
    assert eng.tokenizer.eos_token_id == 1 and 1 in eng.eos_token_ids
    sp = SamplingParams(temperature=0, max_tokens=8)
    out = eng.chat(CONVERSATIONS[1], sp)
    text = eng.tokenizer.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    assert out.prompt == text and text.startswith("<|bos|>") and text.endswith("# assistant:\n")
    ids = eng.tokenizer.encode(text, add_special_tokens=False).ids
    assert out.prompt_token_ids == ids and ids.count(0) == 1        # one bos, from the template
    assert out.token_ids == eng.generate({"prompt_token_ids": ids}, sp).token_ids
    both = eng.chat(CONVERSATIONS[:2], sp)
    assert [o.token_ids for o in both][1] == out.token_ids
