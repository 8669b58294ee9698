"""Per-forward attention metadata for the paged cache: ``build_plan(cache, batch)``.

Built once per forward on the host from the batch's segments (plain ints, small CPU tensors),
then copied to the device in one go; every layer of the forward reuses it.

Addressing (all ids are global rows of a pool: ``page * entries_per_page + row``):
* SWA pool of a layer = the rings (request slot s, position p -> ``s * capacity + p % capacity``)
  followed by a staging area (flat token t of this forward -> ``stage_base + t``). The window
  list of a token at p names positions p-W+1..p (column k <-> position p-W+1+k, -1 below 0):
  positions of this forward come from staging, older ones from the ring. After a layer's
  attention the staged rows of the last ``capacity`` positions of each request move into the
  ring (``ring_src`` -> ``ring_dst``).
* Entry pools (compressed entries, indexer keys) of ratio m: entry j of a request lives in
  page ``page_table[r, j // N]``, row ``j % N`` with N = block_size // m. Entry j is visible to
  the token at p iff j < (p + 1) // m; j0..j1-1 = s//m .. e//m - 1 complete in a forward [s, e).
* Compressor rings (fp32 rows, ratio m): slot s, position p -> ``s * R + p % R``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Emit:
    """One request completing entries j0..j1-1: pool rows of positions jb*m .. j1*m-1, the ones
    before this forward from the compressor ring, the rest from this forward's tokens."""
    j0: int
    j1: int
    jb: int
    ring: tuple        # slice of RatioPlan.ring_read: rows of positions [jb*m, start)
    toks: tuple        # flat token slice: rows of positions [start, j1*m)


@dataclass
class RatioPlan:
    """Per compression ratio m (T tokens, E entries completed in this forward)."""
    ratio: int
    per_page: int                  # entries per page of this ratio's pools
    n_visible: torch.Tensor        # [T] int64: entries j < n_visible[t] are visible to token t
    max_visible: int
    emit_slots: torch.Tensor       # [E] int64 global entry ids written by write_entries
    ring_read: torch.Tensor        # [*] int64 compressor-ring rows read back for pooling
    persist_src: torch.Tensor      # [n] flat token index of rows that stay in the ring ...
    persist_dst: torch.Tensor      # [n] ... and their ring rows
    emits: list = field(default_factory=list)   # [Emit] in request order
    all_visible: torch.Tensor | None = None     # HCA: [T, max_visible] local ids j, -1 pad
    all_visible_ids: torch.Tensor | None = None  # HCA: the same as global ids (global_ids)
    # int32 copies for kernels that take int32 lists (Triton backend): built on the host and
    # moved with everything else, so no per-layer cast kernel
    n_visible_i32: torch.Tensor | None = None
    all_visible_ids_i32: torch.Tensor | None = None


@dataclass
class AttnMetadata:
    """Everything the per-layer calls need for one forward (T tokens, R requests, W window)."""
    positions: torch.Tensor        # [T] int64 absolute positions
    req_index: torch.Tensor        # [T] int64 row of the token's request (page_table, rids)
    cu_seqlens: torch.Tensor       # [R+1] int32 offsets of each request's tokens
    rids: list                     # [R] request ids (batch order)
    starts: list                   # [R] first new position of each request
    lengths: list                  # [R] new tokens of each request
    page_table: torch.Tensor       # [R, max_blocks] int32 (0-padded; only valid rows are read)
    window_ids: torch.Tensor       # [T, W] int64 ids into the layer's SWA pool, -1 = none
    stage_ids: torch.Tensor        # [T] int64 where write_window puts each token's row
    ring_src: torch.Tensor         # [n] staged rows that move into the ring after attend ...
    ring_dst: torch.Tensor         # [n] ... and their ring ids
    ring_split: torch.Tensor       # [4, n] page/row of ring_src and ring_dst (copy_rows' split)
    ratios: dict                   # ratio -> RatioPlan
    position_bound: int = 1        # host int > every position (RoPE table size, no sync)
    rope_memo: dict = field(default_factory=dict)   # RoPE rows of `positions` (Rope.rows)
    req_index_i32: torch.Tensor | None = None      # int32 copies of req_index / window_ids
    window_ids_i32: torch.Tensor | None = None     # (see RatioPlan.n_visible_i32)


def build_plan(cache, batch) -> AttnMetadata:
    """Validate ``batch`` (segments whose ``state`` is a request id) against ``cache``, record
    the forward in it (lengths advance) and return the metadata on the batch's device."""
    c, segs = cache, batch.segments
    if not segs or any(s.length < 1 for s in segs):
        raise ValueError("a forward needs at least one request with at least one new token")
    T = sum(s.length for s in segs)
    rids = [s.state for s in segs]
    if T > c.max_batch_tokens:
        raise ValueError(f"forward of {T} tokens exceeds PagedKVCache(max_batch_tokens="
                         f"{c.max_batch_tokens}); build the cache with a larger value")
    if len(set(rids)) != len(rids):
        raise ValueError("a request appears twice in one forward; give it one contiguous run")
    for s in segs:                     # all checks before any state changes
        c.check_forward(s.state, s.start, s.start + s.length)
    for s in segs:
        c.begin_forward(s.state, s.start, s.start + s.length)

    lens, starts, offs, slots = (torch.tensor(v, dtype=torch.long) for v in zip(
        *[(s.length, s.start, s.offset, c.slot(s.state)) for s in segs]))
    tables = [c.page_table(r) for r in rids]
    page_table = torch.zeros(len(segs), max([1] + [len(t) for t in tables]), dtype=torch.int32)
    for r, t in enumerate(tables):
        page_table[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    req = torch.repeat_interleave(torch.arange(len(segs)), lens)
    tok = torch.arange(T)
    pos = starts[req] + tok - offs[req]
    s_t, end_t, slot_t = starts[req], (starts + lens)[req], slots[req]

    W, C = c.window, c.capacity
    q = pos[:, None] - (W - 1) + torch.arange(W)          # window positions of each token
    win = torch.where(q >= s_t[:, None], c.stage_base + tok[:, None] + q - pos[:, None],
                      slot_t[:, None] * C + q % C)
    keep = pos >= end_t - C        # rows of a long chunk older than that are overwritten anyway
    ring_src, ring_dst = (c.stage_base + tok)[keep], (slot_t * C + pos % C)[keep]
    md = AttnMetadata(
        positions=pos, req_index=req, cu_seqlens=torch.cat([offs, offs[-1:] + lens[-1:]]).int(),
        rids=rids, starts=starts.tolist(), lengths=lens.tolist(), page_table=page_table,
        window_ids=torch.where(q >= 0, win, -1), stage_ids=c.stage_base + tok,
        ring_src=ring_src, ring_dst=ring_dst,
        ring_split=torch.stack([ring_src // C, ring_src % C, ring_dst // C, ring_dst % C]),
        ratios={m: _plan_ratio(c, m, segs, tables, pos, end_t, slot_t, req, page_table)
                for m in sorted({m for m in c.ratios if m})},
        position_bound=max(s.start + s.length for s in segs))
    md.req_index_i32, md.window_ids_i32 = md.req_index.int(), md.window_ids.int()
    return _to_device(md, batch.positions.device)


def _plan_ratio(c, m, segs, tables, pos, end_t, slot_t, req, page_table) -> RatioPlan:
    N, R = c.entries_per_page(m), c.comp_ring(m)
    ring_read, slots, emits = [], [], []
    for r, s in enumerate(segs):
        j0, j1 = s.start // m, (s.start + s.length) // m
        if j1 == j0:
            continue
        # the overlapping ratio-4 compressor also pools the previous window's A-halves
        jb = max(j0 - 1, 0) if m == 4 else j0
        lo, slot = len(ring_read), c.slot(s.state)
        ring_read += [slot * R + p % R for p in range(jb * m, s.start)]
        emits.append(Emit(j0, j1, jb, (lo, len(ring_read)),
                          (s.offset, s.offset + j1 * m - s.start)))
        slots += [tables[r][j // N] * N + j % N for j in range(j0, j1)]
    keep = pos >= end_t - R
    n_vis = (pos + 1) // m
    max_vis = max((s.start + s.length) // m for s in segs)    # = n_vis.max(), from host ints
    plan = RatioPlan(m, N, n_vis, max_vis, torch.tensor(slots, dtype=torch.long),
                     torch.tensor(ring_read, dtype=torch.long), torch.arange(len(pos))[keep],
                     (slot_t * R + pos % R)[keep], emits)
    if m != 4:                     # HCA attends to every visible entry: one list for its layers
        local = torch.arange(plan.max_visible).expand(len(pos), -1)
        plan.all_visible = torch.where(local < n_vis[:, None], local, -1)
        from .backend import global_ids          # (backend imports this module)
        plan.all_visible_ids = global_ids(plan.all_visible, req, page_table, N)
        plan.all_visible_ids_i32 = plan.all_visible_ids.int()
    plan.n_visible_i32 = n_vis.int()
    return plan


def _to_device(md: AttnMetadata, device, pack: bool | None = None) -> AttnMetadata:
    """Move every tensor of the plan to ``device`` in ONE host->device copy: the host tensors
    are packed (8-byte aligned) into one byte buffer, pinned on CUDA, copied non-blocking, and
    the device tensors are views of the copy. ``pack`` defaults to "device is not the CPU"."""
    device = torch.device(device)
    if pack is None:
        pack = device.type != "cpu"
    fields = [(obj, k, v) for obj in (md, *md.ratios.values())
              for k, v in vars(obj).items() if isinstance(v, torch.Tensor)]
    if not pack:
        for obj, k, v in fields:
            setattr(obj, k, v.to(device))
        return md
    offs, total = [], 0
    for _, _, v in fields:
        offs.append(total)
        total += -(-v.numel() * v.element_size() // 8) * 8
    host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=device.type == "cuda")

    def view(buf, off, v):
        n = v.numel() * v.element_size()
        return buf[off:off + n].view(v.dtype).view(v.shape)
    for (_, _, v), off in zip(fields, offs):
        view(host, off, v).copy_(v)
    dev = host.to(device, non_blocking=True)
    for (obj, k, v), off in zip(fields, offs):
        setattr(obj, k, view(dev, off, v))
    return md
