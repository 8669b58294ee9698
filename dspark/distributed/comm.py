"""Process-group plumbing for tensor / expert parallelism (torch.distributed only).

Every rank of a group runs the same forward on the same inputs; the sharded modules call
`TPGroup.all_reduce` / `TPGroup.all_gather` on the default process group (NCCL on GPU, gloo on CPU).
The engine's control messages travel over a separate gloo group (`TPGroup.cpu_group`) whose
timeout is long: an idle engine leaves its workers waiting in a broadcast for the next step.

NVLink multicast (NVLS) stays off wherever NCCL is initialised: `init_distributed` sets
NCCL_NVLS_ENABLE=0 before the NCCL group is created.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# control plane: waiting for the next command may take as long as the engine stays idle
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_init_method(port: int | None = None) -> str:
    return f"tcp://127.0.0.1:{port or free_port()}"


def backend_for(device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device, rank: int) -> torch.device:
    """cuda:(base + rank) for a CUDA engine (base = the index given, default 0); cpu stays cpu."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


@dataclass
class TPGroup:
    """One rank's view of a tensor-parallel group. `group=None` means the default process group;
    with world == 1 every collective is a no-op, so sharded modules also run in one process.

    Every collective has a fixed shape and no host read, so on CUDA it can be captured inside
    a CUDA graph (NCCL). `trace`: a list to append (kind, shape, dtype) of each collective
    issued (for counting a step's communication; None: off)."""
    rank: int = 0
    world: int = 1
    group: Any = None
    cpu_group: Any = None
    trace: list | None = None

    def _note(self, kind: str, t: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append((kind, tuple(t.shape), t.dtype))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks; returns t. Every rank receives the same bits."""
        if self.world > 1:
            self._note("all_reduce", t)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation over ranks (in rank order) along `dim`."""
        if self.world == 1:
            return t
        self._note("all_gather", t)
        t = t.contiguous()
        if t.is_cuda:            # one NCCL call into one buffer (rank-major), then the layout
            out = torch.empty((self.world, *t.shape), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t, group=self.group)
            return torch.cat(out.unbind(0), dim=dim)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: every rank's `t` becomes rank `src`'s (a device tensor on the data group)."""
        if self.world > 1:
            self._note("broadcast", t)
            dist.broadcast(t, src=src, group=self.group)
        return t


# a control message's first broadcast carries this many bytes (length + the usual step's whole
# pickled message); a longer one (a long prefill's token ids) sends its rest in a second
CONTROL_BYTES = 4096
_LEN = 8


def broadcast_message(obj, group, rank: int, src: int = 0):
    """`obj` of rank `src`, pickled, on every rank of the (gloo) `group`: one broadcast of a
    fixed CONTROL_BYTES buffer for messages that fit (torch's broadcast_object_list always
    takes two: the size, then the bytes), a second for the rest of a longer one."""
    head = torch.empty(CONTROL_BYTES, dtype=torch.uint8)
    if rank == src:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n, k = len(data), min(len(data), CONTROL_BYTES - _LEN)
        buf = head.numpy()
        buf[:_LEN] = memoryview(n.to_bytes(_LEN, "little"))
        buf[_LEN:_LEN + k] = memoryview(data)[:k]
        dist.broadcast(head, src=src, group=group)
        if n > k:
            dist.broadcast(torch.frombuffer(bytearray(data[k:]), dtype=torch.uint8), src=src,
                           group=group)
        return obj
    dist.broadcast(head, src=src, group=group)
    buf = head.numpy()
    n = int.from_bytes(buf[:_LEN].tobytes(), "little")
    k = min(n, CONTROL_BYTES - _LEN)
    data = buf[_LEN:_LEN + k].tobytes()
    if n > k:
        rest = torch.empty(n - k, dtype=torch.uint8)
        dist.broadcast(rest, src=src, group=group)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


def init_distributed(rank: int, world: int, init_method: str, device="cpu",
                     timeout_s: float = 1800.0) -> TPGroup:
    """Join the default process group (NCCL for CUDA devices, gloo otherwise) and create the gloo
    control group. Call `destroy_distributed` when done."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; one "
                           "tensor-parallel engine per process (close() the previous one first)")
    backend = backend_for(device)
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"          # keep NVLink multicast off
        torch.cuda.set_device(rank_device(device, rank))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, world, None, cpu_group)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
