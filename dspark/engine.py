"""Engine: load a checkpoint, then score or generate with DSpark speculative decoding.

    from dspark import Engine, SamplingParams
    eng = Engine("path/to/ckpt")                      # speculative="dspark" when mtp.* exists
    out = eng.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))

One `step()` is one DSpark round for every running request (architecture.md):
  policy picks ℓ per request -> one flattened target forward (verify blocks + prefill chunks)
  -> lossless accept/reject (device part: dspark/spec/accept.py) -> the next blocks drafted on
  the device from that result (ModelRunner.draft_ahead) -> one read back -> commit tokens
  (`_commit_state`) while the device drafts -> the next round launched -> this round's text,
  metrics and outputs (`_outputs`) while the device verifies.
Without a drafter, plain decode steps overlap (dspark/overlap.py): a step launches the next
round from the device-side tokens of the one before, then commits that one.

Sampled (temperature > 0) verification without top-k / top-p runs as one fused Triton kernel on
CUDA (`dspark.kernels.sampling.fused_verify`) instead of a few hundred small torch kernels;
DSPARK_REFERENCE_KERNELS=1 forces the torch path (`probs_from_logits` + `verify`), see
`dspark.sampling.fused_sampling_enabled`.

Engine(deterministic=True): the runner's forwards compute every row as they would alone (batch-
invariant uniform graph steps on CUDA, one-token forwards elsewhere) and acceptance is
`spec.accept.decide_gumbel` (Gumbel-max keyed by seed and position, dspark/spec/gumbel.py), so a
request's tokens do not depend on its batch, chunking, speculation or preemption.
"""
from __future__ import annotations

import collections
import itertools
import os
import time

import torch

from .build import build_parts
from .commit import RoundCommit, _Round
from .compile_stats import install_triton_hook
from .cuda.transfer import PinnedReader
from .engine_config import EngineConfig
from .logprobs import record_prompt_logprobs
from .metrics import SpecMetrics
from .model_dir import (check_model_dir, default_model_path, load_sts,  # noqa: F401 (API)
                        load_tokenizer, read_model_type)
from .outputs import RequestOutput, TextStream, request_output
from .overlap import OverlappedDecode
from . import prompts as _prompts
from .request import BlockTokens, Request, Status, sample_seed, stack_field
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .spec.policy import make_policy
from .spec.accept import decide

# a prompt of at most this many round widths is fed inside the rounds' graph steps (Engine.__init__)
GRAPH_PREFILL_STEPS = 32


class Engine(RoundCommit):
    def __init__(self, path: str | None = None, config: EngineConfig | None = None, **settings):
        """Load `path` (default: the shipped model) with `config`, or with keyword settings
        (EngineConfig's fields and the verify policy's options; they replace config's)."""
        c = self.config = EngineConfig.from_kwargs(config, **settings)
        install_triton_hook()          # count Triton compiles (process-wide, once)
        path = self.path = os.fspath(path or default_model_path())
        check_model_dir(path)
        self.device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        c.check_environment(self.device)
        if c.deterministic and self.device.type == "cuda":
            # cuBLAS keeps one workspace per handle and stream; with this fixed configuration
            # its results do not depend on which stream or workspace a call got (read when
            # cuBLAS first initialises in the process: set it before any CUDA work to be sure)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        model_type = read_model_type(path)
        c.check_model_type(model_type)
        self.dtype = c.torch_dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.kv_cache_dtype = c.kv_cache_dtype
        self.tensor_parallel_size = c.tensor_parallel_size
        # model, drafter, KV cache, attention backend and runner: dspark/build.py
        parts = build_parts(path, c, self.device, self.dtype, model_type)
        c.check_drafter(parts.drafter is not None)
        cfg = self.cfg = parts.cfg
        self.model, self.drafter, self.runner = parts.model, parts.drafter, parts.runner
        self.speculative, self.weight_format = parts.speculative, parts.weight_format
        backend = getattr(self.runner, "backend", None)
        self.cache = getattr(backend, "cache", None)          # None: the dense layout
        self.overlap = OverlappedDecode(self) if self._overlap_decode(c) else None
        self._reader = PinnedReader((self.gamma + 1) * c.max_num_seqs)   # a round's read back
        self._launched = None      # the round queued on the device, not read back yet (step())
        self._landed: list = []    # outputs of a round landed outside step(), for the next one
        if self.device.type == "cpu" and (c.cpu_threads or cfg.hidden_size <= 1024):
            # small models on CPU are bound by per-op overhead: intra-op threads only add
            # synchronisation (measured 10-100x slower with 2 threads on a busy 2-core box)
            torch.set_num_threads(c.cpu_threads or 1)
        self.scheduler = Scheduler(c.max_num_seqs, c.max_num_batched_tokens, self.cache)
        self.sts = load_sts(path)
        self.policy = self._make_policy(c) if self.drafter is not None else None
        if hasattr(self.policy, "uniform"):    # the scheduled policies price padded rounds
            self.policy.uniform = getattr(self.runner, "uniform_verify", False)
        self.telemetry = collections.deque(maxlen=4096)   # per-step batch composition
        self.landed_telemetry = None   # the entry of the round the last step() committed
        self.round_log = None     # set to a list to record (conf logits, verified, accepted) per round
        # (the prompt-length error names what set the limit: the model or the cache)
        self.max_model_len, self._max_model_len_limit = c.check_max_model_len(
            cfg.max_position_embeddings, self.cache)
        if self.policy is not None:
            # where the runner replays uniform steps (_verify_lengths gives the width), short
            # prompts ride in the round's graph step, one round width per step
            # (Scheduler.schedule): up to GRAPH_PREFILL_STEPS steps beat one eager prefill,
            # which stalls every running request for its whole (host-bound) length
            self.scheduler.graph_prefill_tokens = GRAPH_PREFILL_STEPS * (1 + self.policy_width())
            self.scheduler.max_model_len = self.max_model_len
        self.tokenizer = load_tokenizer(path)
        eos = [cfg.eos_token_id, getattr(self.tokenizer, "eos_token_id", None)]
        self.eos_token_ids = tuple(dict.fromkeys(t for t in eos if t is not None))
        self._seed = c.seed
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}       # by sample: n > 1 gives n entries
        self._groups: dict[str, list] = {}           # request id -> its samples' Requests

    def _overlap_decode(self, c: EngineConfig) -> bool:
        """Plain decode steps (no drafter) launch the next round before reading this one back
        (dspark/overlap.py): on by default on CUDA with the single-device DeepSeek-V4 runner."""
        plain_runner = type(self.runner) is ModelRunner
        if c.overlap_decode is None:
            return self.device.type == "cuda" and plain_runner
        if c.overlap_decode and not plain_runner:
            raise ValueError("overlap_decode=True needs the single-device DeepSeek-V4 runner "
                             "(not Qwen3 or tensor-parallel); leave it unset")
        return c.overlap_decode

    def _make_policy(self, c: EngineConfig):
        options = dict(c.policy_options)
        if c.verify_policy in ("scheduled", "scheduled-async", "alg1", "zos"):
            from .spec.profile import sps_table
            options["sps"] = sps_table(self, c.sps_table, c.max_num_seqs, c.progress)
        if self.sts is not None:
            options.setdefault("temperatures", self.sts.temperatures)
        return make_policy(c.verify_policy, **options)

    # ---- public API --------------------------------------------------------------------
    def score(self, token_ids) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] for every position of one sequence."""
        ids = self._check_prompt(token_ids)
        self._drain()                   # its forward reuses the buffers a launched round reads
        if self.cache is None:
            state, _ = self.runner.new_states()
            logits, _ = self.runner.target_forward([(state, 0, ids)])
            return logits.float().cpu()
        rid = ("score", next(self._ids))
        self.cache.add_request(rid)
        try:
            self.cache.reserve(rid, len(ids))
            logits, _ = self.runner.target_forward([(rid, 0, ids)])
        finally:
            self.cache.free(rid)
        return logits.float().cpu()

    def generate(self, prompts, params: SamplingParams | list | None = None,
                 progress: bool | None = None):
        """prompts: one prompt or a list of them; a prompt is a string, token ids (list, tuple
        or 1-D tensor of ints), {"prompt": str} or {"prompt_token_ids": ids}. Returns one
        RequestOutput (one prompt) or a list in prompt order. progress: a tqdm bar over the
        requests; None = on for several prompts when stderr is a terminal."""
        single = _prompts.is_single(prompts)
        prompts = [prompts] if single else list(prompts)
        if not prompts:     # [] could mean no prompts or an empty one: neither can run
            raise ValueError("empty prompt list: pass a prompt (a string or token ids) or a "
                             "non-empty list of prompts")
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one "
                             f"SamplingParams or one per prompt")
        ids = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(p, sp))
        except Exception:
            for rid in ids:                 # a bad prompt admits none of the batch
                self.abort(rid)
            raise
        done = {}
        if progress is None:
            import sys
            progress = len(ids) > 1 and sys.stderr.isatty()
        from tqdm import tqdm
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not progress) as bar:
            while self.has_unfinished():
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        outs = [done[i] for i in ids]
        return outs[0] if single else outs

    def chat(self, messages, params: SamplingParams | None = None, *,
             add_generation_prompt: bool = True, chat_template: str | None = None, **template_kwargs):
        """Generate a reply to one conversation (a list of {"role", "content"} dicts), or to each
        of a list of conversations, through the checkpoint's chat template
        (tokenizer_config.json, rendered as transformers renders it)."""
        single, texts = _prompts.render_chat(self.tokenizer, self.path, messages,
                                             add_generation_prompt, chat_template, template_kwargs)
        # the template writes the special tokens: encode without adding them again
        outs = self.generate([{"prompt_token_ids": self.tokenizer.encode(
            t, add_special_tokens=False).ids} for t in texts], params)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs[0] if single else outs

    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None) -> str:
        """Admit one request (SamplingParams.n samples of it); returns its id. ValueError naming
        the problem for a bad prompt, bad params or an id in use; nothing is admitted then.
        Between steps a round is usually queued already (step()): the request joins the next."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}: "
                             f"pass SamplingParams(...)")
        params = params.validate(self.cfg.vocab_size)
        text, ids = _prompts.parse(prompt, self.tokenizer, self.cfg.vocab_size,
                                   self.max_model_len, self.path)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                             f"({self._max_model_len_limit}): shorten the prompt")
        rid = str(request_id if request_id is not None else next(self._ids))
        sample_ids = [rid] if params.n == 1 else [f"{rid}[{k}]" for k in range(params.n)]
        for sid in dict.fromkeys([rid] + sample_ids):
            if sid in self._groups or sid in self.requests:
                raise ValueError(f"request_id {sid!r} is already in use: pass another request_id "
                                 f"(or None for a fresh one)")
        if self.cache is not None:
            self.cache.can_admit(len(ids))            # raises CacheTooSmall with the fix
        stop_ids = params.all_stop_ids(self.eos_token_ids)
        group = []
        for k, sid in enumerate(sample_ids):
            req = Request(sid, ids, params, sample_seed(params.seed, k, self._seed, sid),
                          metrics=SpecMetrics(),
                          arrival_time=time.perf_counter(), stop_ids=stop_ids, parent=rid, index=k)
            req.target_state, req.draft_state = self.runner.new_states()
            if self.cache is not None:
                req.target_state = sid                # paged: the request id is the handle
            if self.tokenizer is not None:
                req.detok, req.text = TextStream(self.tokenizer, params.stop,
                                                 params.include_stop_str_in_output,
                                                 params.min_tokens), ""
            if params.logprobs is not None:
                req.logprobs = []
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            req.prompt_text = text
            group.append(req)
        self._groups[rid] = group
        for req in group:
            self.requests[req.request_id] = req
            self.scheduler.add(req)
        return rid

    def request_ids(self) -> list:
        """Ids of the requests not finished yet."""
        return list(self._groups)

    def warmup(self, prompt_lengths=None, batch_sizes=None, progress: bool = False) -> dict:
        """Compile kernels and capture CUDA graphs for the shapes traffic will hit, before any
        request is added (dummy requests; dspark/warmup.py). Returns what ran and how long."""
        from .warmup import warm_up
        self._drain()
        return warm_up(self, prompt_lengths, batch_sizes, progress=progress)

    def compile_stats(self) -> dict:
        """One-time costs so far (dspark/compile_stats.py): {"triton_compiles": n (process-wide;
        "unavailable" without Triton's hook), "graph_captures": n, "eager_fallbacks":
        {"target: ragged lengths": n, ...}} (steps a graph-capable runner ran eagerly, by why)."""
        from .compile_stats import runner_stats, triton_compiles
        return {"triton_compiles": triton_compiles(), **runner_stats(self.runner)}

    def close(self) -> None:
        """Stop the worker processes of a tensor-parallel engine and leave its process group
        (no-op otherwise; also done at interpreter exit)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def has_unfinished(self) -> bool:
        launched = self._launched        # (its requests may all have been aborted since)
        return (self.scheduler.has_unfinished() or bool(self._landed) or (
            launched is not None and any(r.status != Status.FINISHED for r in launched.reqs)))

    def abort(self, request_id) -> bool:
        """Stop a request (all its samples) now and free all its cache state; other requests are
        not touched. Returns False for an unknown or already finished id."""
        return self.abort_request(request_id) is not None

    def abort_request(self, request_id) -> RequestOutput | None:
        """abort(), returning the request's final RequestOutput (finish_reason "abort" for the
        samples still running, text held back included); None for an unknown id."""
        group = self._groups.pop(str(request_id), None)
        if group is None:
            return None
        # outputs of a round landed outside step() (score()) that the abort output supersedes
        self._landed = [o for o in self._landed if o.request_id != str(request_id)]
        now = time.perf_counter()
        for req in group:
            if req.status != Status.FINISHED:
                req.finish_reason, req.finish_time = "abort", now
                self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            self._release(req)
        return request_output(group, None, [])

    def stream(self, prompt, params: SamplingParams | None = None):
        """Generate one request, yielding a RequestOutput with its token/text deltas every step
        (other requests already added keep running in the same steps)."""
        rid = self.add_request(prompt, params)
        while True:
            outs = [o for o in self.step() if o.request_id == rid]
            for o in outs:
                yield o
                if o.finished:
                    return
            if rid not in self._groups:
                return

    # ---- one DSpark round ----------------------------------------------------------------
    def step(self) -> list:
        """One round for every running request; returns a RequestOutput per request that got
        tokens (or finished). The round committed is the one launched by the previous call (or
        now, if none was), and the next round is launched before this one's outputs are built,
        so the device verifies while the host builds them (text, metrics, RequestOutputs).
        With overlapped decode the round committed is the one launched by the previous call,
        while this call's round runs on the device."""
        outs, self._landed = self._landed, []         # outputs of a round drained outside step()
        if self.overlap is not None and self._launched is None:
            if self.overlap.applies():
                done = self.overlap.step()
                if done is not None:
                    return outs + done
            outs += self.overlap.drain()  # a prompt waits, or pages ran short: ordinary round
        rnd, self._launched = self._launched, None
        if rnd is not None and rnd.reqs and all(r.status == Status.FINISHED for r in rnd.reqs):
            self._land(rnd)             # all its requests were aborted since: nothing to commit
            rnd = None
        if rnd is None:
            rnd = self._launch()
        if rnd is None:
            return outs
        work = self._land(rnd)
        if self.scheduler.has_unfinished() and not (self.overlap is not None
                                                    and self.overlap.applies()):
            try:
                self._launched = self._launch()
            except BaseException:
                # the landed round is committed: its outputs go out with the next step
                self._landed = outs + self._outputs(work)
                raise
        return outs + self._outputs(work)

    def _drain(self) -> None:
        """Land the round in flight, if any, keeping its outputs for the next step() (before
        anything else queues device work: its logits and taps are the runner's buffers)."""
        rnd, self._launched = self._launched, None
        if rnd is not None:
            self._landed += self._outputs(self._land(rnd))

    def _launch(self):
        """1. ℓ per request (policy) and its pages; 2. one flattened target forward of the
        verify blocks and prompt chunks; 3. accept / reject, on the device; 5. the next blocks
        drafted from that device-side result, and the read back of the acceptance queued: the
        device drafts while the host commits (`_land`: 4.). Where a draft needs host-side
        history (Engine._drafts_ahead), 5. follows 4. None when nothing was launched."""
        sch = self.scheduler
        width = self._verify_lengths(sch.running)                               # 1.
        plan = sch.schedule(prefill_width=width)
        for req in plan.preempted:                       # recomputed later from their tokens
            req.draft_state = self.runner.new_states()[1]
        items = self._forward_items(plan)                                       # 2.
        if not items:
            if sch.has_unfinished():    # cannot happen when admission checks hold; never spin
                raise RuntimeError("scheduler could not place any work although requests are "
                                   "waiting; the KV cache is too small for them (raise "
                                   "num_kv_blocks / kv_cache_memory or lower max_num_seqs)")
            return None
        # read by decide (step 3) before any other forward is queued: no snapshot copy needed
        logits, taps = self.runner.target_forward(items, snapshot=False)
        tel = {"batch_tokens": plan.num_tokens, "num_verify": len(plan.verify),
               "verify_tokens": [r.verify_len for r in plan.verify],
               "prefill_tokens": sum(n for _, n in plan.prefill)}
        self.telemetry.append(tel)
        producers = self._producers(plan, items, logits, taps)
        rnd = self._accept(*producers, logits, taps)                            # 3. 5.
        rnd.telemetry = tel
        return rnd

    def _accept(self, reqs, first_rows, lengths, anchor_pos, logits, taps) -> "_Round":
        """The device part of acceptance and the next blocks drafted from it, with the read
        back of its result queued (one copy: [argmax | a, y] and the drafts)."""
        if not reqs:
            self._draft_running()
            return _Round([], None, None, None, None, taps, [], [], [], logits)
        dec = decide(reqs, logits, first_rows, lengths, anchor_pos, self.gamma,
                     deterministic=self.config.deterministic)
        host, ready = self._reader.read(dec.table())
        blocks = None
        if self._drafts_ahead(reqs):
            # the next blocks are queued behind the acceptance before the host reads it: the
            # device drafts while the host commits (the read waits for the acceptance alone)
            blocks = self.runner.draft_ahead(reqs, *dec.accepted_next(), taps, first_rows,
                                             anchor_pos, [r.status == Status.RUNNING for r in reqs])
        return _Round(reqs, dec, host, ready, blocks, taps, first_rows, lengths, anchor_pos,
                      logits)

    def _land(self, rnd: "_Round") -> list:
        """4. The round's one read back and the commit of what the next round reads (tokens,
        stops, draft context, cache rollback, finishes); requests aborted while it ran are left
        out. Returns the per-request work left for `_outputs`."""
        self.landed_telemetry = rnd.telemetry
        if not rnd.reqs:
            return []
        if rnd.ready is not None:
            rnd.ready.synchronize()
        table = rnd.host.tolist()
        keep = [i for i, r in enumerate(rnd.reqs) if r.status != Status.FINISHED]
        if not keep:
            # every request of the round was aborted: the running requests it did not carry
            # (recomputed after a preemption) still need their first block
            self._draft_running()
            return []
        pick = (lambda xs: [xs[i] for i in keep]) if len(keep) < len(rnd.reqs) else list
        reqs = pick(rnd.reqs)
        if rnd.blocks is None:
            then, written = self._draft_running, False
        else:
            blocks = pick(rnd.blocks)

            def then(finishing):
                for req, block in zip(reqs, blocks):
                    if req.request_id not in finishing:
                        req.draft = block
                # the running requests that were not in the round
                self._draft_running(finishing | {r.request_id for r in reqs})
            written = True
        return self._commit_state(reqs, rnd.dec, pick(table), rnd.taps, pick(rnd.first_rows),
                                  pick(rnd.lengths), pick(rnd.anchor_pos), logits=rnd.logits,
                                  then=then, context_written=written)

    def _draft_running(self, finishing=frozenset()) -> None:
        """The next DSpark block of every running request but the `finishing` ids (one batched
        draft pass)."""
        running = [r for r in self.scheduler.running if r.request_id not in finishing]
        if self.drafter is not None and running:
            for req, block in zip(running, self.runner.draft(running)):
                req.draft = block

    def _forward_items(self, plan) -> list:
        """(target state, first position, tokens) per verify block (anchor + `feed_len` drafts)
        and per prompt chunk, in the forward's row order."""
        items = []
        # runners that take the drafts as device tensors (V4 target graphs) get them without a
        # host read, so this step is scheduled while the draft pass still runs on the GPU
        lazy = getattr(self.runner, "takes_device_tokens", False)
        for req in plan.verify:
            if req.draft is None:
                toks = [req.anchor]
            elif lazy:
                toks = BlockTokens.of_block(req.anchor, req.draft, req.feed_len)
            else:
                toks = [req.anchor] + req.draft.tokens[:req.feed_len].tolist()
            items.append((req.target_state, req.num_committed, toks))
        for req, n in plan.prefill:
            toks = req.prefill_ids[req.num_prefilled:][:n]
            # a chunk padded to the step's width (Scheduler.schedule): the padding rows repeat
            # the last token and are rolled back in _producers
            items.append((req.target_state, req.num_prefilled,
                          toks + toks[-1:] * (req.chunk_feed - n)))
        return items

    def _producers(self, plan, items, logits, taps) -> tuple:
        """(requests, first row, ℓ, anchor position) of every request that emits tokens this
        round: each verify block, and each prompt whose last chunk this was (a verify of length
        0 at the last prompt row). Prompt chunks commit their draft context here."""
        offsets = list(itertools.accumulate([len(t) for _, _, t in items], initial=0))
        reqs, first_rows, lengths, anchors = [], [], [], []
        for i, req in enumerate(plan.verify):
            reqs.append(req), first_rows.append(offsets[i]), lengths.append(req.verify_len)
            anchors.append(req.num_committed)
        for j, (req, n) in enumerate(plan.prefill):
            i = len(plan.verify) + j
            rows = slice(offsets[i], offsets[i] + n)          # the chunk's prompt rows
            if self.drafter is not None:
                self.runner.commit_context(req.draft_state, taps[rows], req.num_prefilled)
            if req.prompt_logprobs is not None:
                record_prompt_logprobs(req, logits[rows], req.num_prefilled, self.tokenizer)
            req.num_prefilled += n
            if req.chunk_feed > n:              # padding rows: as if never fed
                self.cache.truncate(req.request_id, req.num_prefilled)
            if req.num_prefilled < len(req.prefill_ids):
                continue
            if req.output_ids:                  # recomputed after preemption: anchor known
                self.scheduler.promote(req)
            else:
                reqs.append(req), first_rows.append(rows.stop - 1), lengths.append(0)
                anchors.append(req.num_prefilled - 1)
        return reqs, first_rows, lengths, anchors

    def _verify_lengths(self, running) -> int:
        """Per running request ℓ = `verify_len`, the drafts acceptance may take (the policy's
        choice, never past max_tokens or the model length: those drafts could not be emitted),
        and `feed_len` >= ℓ, the drafts the target forward carries. Where the runner replays
        uniform steps as CUDA graphs (`uniform_verify`) every block is fed to the widest ℓ of
        the round with its own next drafts: rows past ℓ change no earlier row (attention is
        causal, everything else per token) and are rolled back with the rejected ones, so the
        result is the ragged step's, as one graph replay instead of an eager forward.
        Returns the tokens per request of such a uniform step (the width short prompts are fed
        in, Scheduler.schedule), 0 where steps are not uniform or have no drafts."""
        for req in running:
            req.verify_len = req.feed_len = 0
        uniform = getattr(self.runner, "uniform_verify", False)
        if self.policy is None:
            return 0
        if not running:     # prompts only: the widest step the policy's rounds replay
            return 1 + self.policy_width() if uniform else 0
        lens = self._policy_lengths(running)
        for req, n in zip(running, lens):
            room = min(req.params.max_tokens - len(req.output_ids) - 1,
                       self.max_model_len - req.num_committed - 1)
            req.verify_len = req.feed_len = max(0, min(int(n), room))
        if not uniform:
            return 0
        # the policy's own widest choice, before the budgets cut it: with a fixed ℓ every round
        # then has one width (its graphs captured by the warm-up), also when all the requests
        # of a round are near their max_tokens
        width = min(max(int(n) for n in lens), self.drafter.gamma)
        for req in running:
            if req.draft is not None:   # pages exist up to the model length, not past it
                req.feed_len = max(req.verify_len, min(
                    width, self.max_model_len - req.num_committed - 1))
        return 1 + width

    def _policy_lengths(self, running) -> list:
        """The policy's ℓ per running request. A fixed ℓ needs no confidences, and where rounds
        are padded to one width the scheduled policies choose it from earlier rounds' (on the
        host already): then nothing here waits for the draft pass, and the verify step is queued
        behind it on the device. Otherwise the confidences are read (a wait for the draft pass)."""
        lens = self.policy.host_lengths(len(running), self.drafter.gamma)
        if lens is not None:
            return lens
        ids = [r.request_id for r in running]
        conf = stack_field([r.draft for r in running], "conf_logits")
        width = self.policy.host_width(ids, [r.num_committed for r in running], conf)
        return [width] * len(running) if width is not None else self.policy(conf, ids).tolist()

    def policy_width(self) -> int:
        """The most drafts a round of this policy verifies per request: ℓ of the fixed policy,
        else γ."""
        fixed = self.policy.host_lengths(1, self.drafter.gamma)
        return min(fixed[0], self.drafter.gamma) if fixed is not None else self.drafter.gamma

    def _drafts_ahead(self, reqs) -> bool:
        """Whether this round drafts its next blocks before the host reads its acceptance: the
        runner can (runner.drafts_ahead) and no request's draft depends on host-side history
        (penalties, logit_bias, min_tokens: their adjustment reads the committed tokens)."""
        return (self.drafter is not None and self.runner.drafts_ahead
                and not any(r.params.adjusts_logits for r in reqs))

    @property
    def gamma(self) -> int:
        """Drafted tokens per round (1 without a drafter: the width of the acceptance tables)."""
        return self.drafter.gamma if self.drafter is not None else 1

    def _token_limit(self, req: Request) -> int:
        """Most output tokens the request may have: max_tokens, or what the model length allows."""
        return min(req.params.max_tokens, self.max_model_len - len(req.prompt_ids))

    # ---- helpers -------------------------------------------------------------------------
    def memory_report(self, model=None, drafter=None) -> dict:
        """Weight bytes held by this process by storage format: {"fp8", "fp4" (codes + e8m0
        scales), "bf16", "fp32", "int64", ..., "total"}; tensors shared by target and drafter
        count once."""
        from .models.qlinear import memory_report
        if model is None:
            model, drafter = self.model, self.drafter
        return memory_report(model, drafter)

    def _check_prompt(self, prompt) -> list:
        return _prompts.parse(prompt, self.tokenizer, self.cfg.vocab_size,
                              getattr(self, "max_model_len", None), self.path)[1]
