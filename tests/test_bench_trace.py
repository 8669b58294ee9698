"""dspark.bench.trace: device kernels are charged to the innermost phase range they start in."""
from dspark.bench.trace import attribute_kernels


def test_kernels_go_to_the_innermost_phase():
    ev = [{"cat": "user_annotation", "name": "phase:other", "ts": 0, "dur": 100},
          {"cat": "user_annotation", "name": "phase:draft", "ts": 10, "dur": 20},
          {"cat": "user_annotation", "name": "phase:sampling+accept", "ts": 40, "dur": 30},
          {"cat": "user_annotation", "name": "phase:commit", "ts": 50, "dur": 5},
          {"cat": "user_annotation", "name": "unrelated", "ts": 0, "dur": 1000},
          {"cat": "kernel", "name": "a", "ts": 12, "dur": 3},
          {"cat": "kernel", "name": "a", "ts": 29, "dur": 4},      # starts inside, ends after
          {"cat": "kernel", "name": "b", "ts": 52, "dur": 1},      # commit inside sampling
          {"cat": "kernel", "name": "c", "ts": 45, "dur": 2},
          {"cat": "kernel", "name": "d", "ts": 90, "dur": 2},
          {"cat": "kernel", "name": "e", "ts": 500, "dur": 1},
          {"cat": "cpu_op", "name": "aten::mm", "ts": 12, "dur": 1}]
    per = attribute_kernels(ev)
    assert per["draft"]["kernels"] == 2 and per["draft"]["busy_us"] == 7.0
    assert per["draft"]["by_name"] == {"a": [2, 7.0]}
    assert per["commit"]["by_name"] == {"b": [1, 1.0]}
    assert per["sampling+accept"]["by_name"] == {"c": [1, 2.0]}
    assert per["other"]["by_name"] == {"d": [1, 2.0]}
    assert per["(outside)"]["by_name"] == {"e": [1, 1.0]}
    assert sum(v["kernels"] for v in per.values()) == 6
