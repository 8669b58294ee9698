"""Host work of a target forward (issue 7): no device->host syncs inside the DeepSeek-V4 target
forward of a paged decode / verify step, and the attention plan reaches the device in one copy.

On CPU a sync costs nothing, so it is counted instead: every `aten._local_scalar_dense`
(`.item()`, `int(t)`, `bool(t)`, `if t:` ...) and every `Tensor.tolist()` while the model's
`forward_hidden` / `logits` run. Excluded: the backend's storage hooks (`store`, `select`,
`sparse_mqa`), which are single Triton kernels on GPU while the reference versions used here
check their index lists on purpose; and the MoE runs its gathered path (the one CUDA uses).
"""
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark import Engine
from dspark.attention.plan import _to_device, build_plan
from dspark.models.deepseek_v4.model import Batch
from dspark.models.deepseek_v4.moe import MoE
from dspark.models.deepseek_v4.rope import Rope


class SyncGuard(TorchDispatchMode):
    """Records a stack for every device->host read while `armed` (and not paused)."""

    def __init__(self):
        super().__init__()
        self.hits, self.armed, self.paused = [], False, 0

    def record(self, what):
        if self.armed and not self.paused:
            self.hits.append(what + "\n" + "".join(traceback.format_stack(limit=10)[:-2]))

    def arm(self, fn):
        """fn, recording the reads made while it runs."""
        def wrapped(*a, **k):
            self.armed = True
            try:
                return fn(*a, **k)
            finally:
                self.armed = False
        return wrapped

    def watch_tolist(self, monkeypatch):
        """Count Tensor.tolist() too (not a dispatched op)."""
        tolist = torch.Tensor.tolist

        def guarded_tolist(t):
            self.record("Tensor.tolist")
            return tolist(t)
        monkeypatch.setattr(torch.Tensor, "tolist", guarded_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (under inference_mode `.item()` / `int(t)` dispatch as aten.item, else as
        # aten._local_scalar_dense)
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.item):
            self.record(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def engine():
    return Engine(device="cpu", max_num_seqs=2)       # DSpark on: rings keep verify rollbacks


def _guarded(engine, monkeypatch):
    guard = SyncGuard()
    model, be = engine.model, engine.runner.backend

    arm = guard.arm

    def pause(fn):
        def wrapped(*a, **k):
            guard.paused += 1
            try:
                return fn(*a, **k)
            finally:
                guard.paused -= 1
        return wrapped

    monkeypatch.setattr(model, "forward_hidden", arm(model.forward_hidden))
    monkeypatch.setattr(model, "logits", arm(model.logits))
    for hook in ("store", "select", "sparse_mqa"):
        monkeypatch.setattr(be, hook, pause(getattr(be, hook)))
    monkeypatch.setattr(MoE, "gathered_devices", ("cuda", "cpu"))
    guard.watch_tolist(monkeypatch)
    return guard


def test_no_device_to_host_sync_in_paged_decode_and_verify(engine, monkeypatch):
    runner, cache = engine.runner, engine.cache
    rid = "sync-test"
    cache.add_request(rid)
    try:
        prompt = [(7 * i + 3) % engine.cfg.vocab_size for i in range(37)]
        cache.reserve(rid, 64)
        runner.target_forward([(rid, 0, prompt)])           # prefill (not guarded)
        guard = _guarded(engine, monkeypatch)
        p = len(prompt)
        with guard:
            for _ in range(6):                                # decode steps, some emit entries
                runner.target_forward([(rid, p, [5])], logit_rows=[0])
                p += 1
            runner.target_forward([(rid, p, [5, 6, 7, 8, 9, 10])])   # verify block of 6
            cache.truncate(rid, p + 2)
            p += 2
            runner.target_forward([(rid, p, [11])])
        assert guard.hits == [], (f"{len(guard.hits)} device->host syncs inside the target "
                                  f"forward; first:\n{guard.hits[0]}")
    finally:
        cache.free(rid)


def test_guard_sees_syncs(engine, monkeypatch):
    """The guard is not vacuous: RoPE without a host-side bound reads positions.max()."""
    guard = SyncGuard()
    guard.armed = True
    rope = Rope(64, 10000.0)
    for mode in (torch.no_grad, torch.inference_mode):
        guard.hits.clear()
        with mode(), guard:
            rope.rows(torch.arange(5), "cpu")
        assert len(guard.hits) == 1
        guard.hits.clear()
        with mode(), guard:
            rope.rows(torch.arange(5), "cpu", bound=5)
        assert guard.hits == []


def test_rope_bound_and_memo_are_exact():
    rope = Rope(64, 10000.0, {"factor": 4, "original_seq_len": 64, "beta_fast": 32,
                              "beta_slow": 1})
    pos = torch.tensor([3, 300, 17])
    x = torch.randn(3, 2, 128)
    ref = rope.apply(x, pos)
    memo = {}
    assert torch.equal(rope.apply(x, pos, bound=301, memo=memo), ref)
    assert torch.equal(rope.apply(x, pos, bound=301, memo=memo), ref)     # memo hit
    assert torch.equal(rope.apply(x, pos, inverse=True, bound=301, memo=memo),
                       rope.apply(x, pos, inverse=True))
    assert len(memo) == 2


def test_plan_moves_to_device_in_one_packed_copy(engine):
    cache = engine.cache
    rids = ["pack-a", "pack-b"]
    try:
        for r, n in zip(rids, (9, 300)):
            cache.add_request(r)
            cache.reserve(r, n + 6)
            cache.begin_forward(r, 0, n)
            cache.truncate(r, n)
        batch = Batch.build([("pack-a", 9, [1, 2, 3]), ("pack-b", 300, [4])], "cpu")
        assert batch.position_bound == 301
        md = build_plan(cache, batch)
        ref = {(id(o), k): v.clone() for o in (md, *md.ratios.values())
               for k, v in vars(o).items() if isinstance(v, torch.Tensor)}
        packed = _to_device(md, "cpu", pack=True)
        storages = set()
        for o in (packed, *packed.ratios.values()):
            for k, v in vars(o).items():
                if isinstance(v, torch.Tensor):
                    assert v.dtype == ref[id(o), k].dtype and torch.equal(v, ref[id(o), k]), k
                    storages.add(v.untyped_storage().data_ptr())
        assert len(storages) == 1                 # every plan tensor is a view of one buffer
        assert packed.position_bound == 301
    finally:
        for r in rids:
            cache.free(r)
