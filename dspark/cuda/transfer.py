"""Host lists to device tensors without a host synchronisation."""
from __future__ import annotations

import torch


def to_device(rows, dtype, device) -> torch.Tensor:
    """Host lists -> device tensor without a host sync: on CUDA through pinned memory and an
    asynchronous copy (the caching host allocator keeps the pinned block until the copy ran)."""
    t = torch.tensor(rows, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class PinnedReader:
    """Device-to-host reads that do not wait for work queued after them: `read(t)` copies t into
    one of two alternating pinned buffers (round n's copy may still be pending while round n+1's
    is queued) and records an event right after the copy; `ready.synchronize()` then waits for
    that copy alone. On CPU: a clone and no event."""

    def __init__(self, min_numel: int = 0):
        self.min_numel = min_numel
        self._buffers = [None, None]
        self._turn = 0

    def read(self, t: torch.Tensor):
        """(host tensor, torch.cuda.Event or None): the host tensor holds t once the event has
        completed; valid until the read after next."""
        if not t.is_cuda:
            return t.clone(), None
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self._buffers[self._turn] = torch.empty(max(t.numel(), self.min_numel),
                                                          dtype=t.dtype, pin_memory=True)
        self._turn ^= 1
        host = buf[:t.numel()].view(t.shape)
        host.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        # the stream by device index: Event.record() alone looks the current device up through
        # ~10 Python calls (~25 us of host per read on the H200 host)
        ready.record(torch.cuda.current_stream(t.device.index))
        return host, ready


class StagedUpload:
    """Host rows into a fixed device buffer (a CUDA graph's input) through a pinned staging
    buffer kept per destination: no pinned allocation per upload, one numpy write and one
    asynchronous copy. The staging buffer is rewritten only after its previous copy has left it
    (an event per destination; normally long done, a round ago)."""

    def __init__(self):
        self._staged: dict = {}         # (address, shape, dtype) -> [pinned tensor, event]

    def __call__(self, dst: torch.Tensor, rows, dtype) -> None:
        if dst.device.type != "cuda":
            dst.copy_(torch.tensor(rows, dtype=dtype))
            return
        key = (dst.data_ptr(), tuple(dst.shape), dtype)
        entry = self._staged.get(key)
        if entry is None:
            entry = self._staged[key] = [torch.empty(dst.shape, dtype=dtype, pin_memory=True),
                                         None]
        elif entry[1] is not None:
            entry[1].synchronize()
        entry[0].numpy()[...] = rows
        dst.copy_(entry[0], non_blocking=True)
        entry[1] = torch.cuda.Event()
        entry[1].record(torch.cuda.current_stream(dst.device.index))
