"""The results index of `python -m dspark.bench --profile`: every shipped benchmark result gets a
readable line (its layout recognised), and an unknown layout falls back to its keys."""
import glob
import os

import pytest

from dspark.bench.profile import default_results_dir
from dspark.bench.results import summarize, summarize_file

SHIPPED = sorted(glob.glob(os.path.join(default_results_dir(), "*.json")))


def test_results_dir_has_files():
    assert SHIPPED, default_results_dir()


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_every_shipped_result_is_summarised(path):
    line = summarize_file(path)
    assert not line.startswith(("keys ", "unreadable")), line
    assert any(ch.isdigit() for ch in line), line      # it reports numbers


def test_layouts():
    sweep = {"args": {"tokens_per_req": 2}, "flashmla_us": {"64": 50.0},
             "best": {"128": {"median_us": 75.0}, "32": {"median_us": 40.0}}}
    assert summarize(sweep) == "sparse MQA best per batch: b16 40.0 us, b64 75.0 us = 1.50x FlashMLA"
    eng = {"args": {"temperature": 0.0}, "results": [
        {"concurrency": 1, "speedup": 2.0, "dspark": {"tau": 3.0, "tok_s": 200.0},
         "off": {"tau": 1.0, "tok_s": 100.0}}]}
    assert summarize(eng) == "T=0.0 c1: tau 3.00, 200.0 vs 100.0 tok/s = 2.00x"
    assert summarize({"summary": "done", "device": {"name": "X"}}) == "done  [X]"
    assert summarize({"b": 1, "a": 2}) == "keys ['a', 'b']"
    # a recognised layout with a missing field says so instead of raising
    assert summarize({"step_us": {"x": "fast"}}).startswith("unreadable step_us result")
