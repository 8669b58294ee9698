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
