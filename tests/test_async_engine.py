"""AsyncEngine: concurrent streams, cancellation and aborts, bad input, engine failures."""
import asyncio
import contextlib
import random
import time

import pytest

from dspark import Engine, SamplingParams
from dspark.async_engine import AsyncEngine, EngineDeadError, EngineError, _find_cache

MAX_LEN = 48          # small max_model_len makes the "prompt too long" request cheap


def _engine(path, **kw):
    return Engine(path, device="cpu", dtype="fp32", kv_cache_dtype="fp32", max_model_len=MAX_LEN,
                  **kw)


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """(engine served by the AsyncEngines of this module, separate reference engine)."""
    return _engine(tiny_ckpt), _engine(tiny_ckpt)


@pytest.fixture(scope="module")
def overlap_engines(tiny_ckpt):
    """Speculation off: the served engine decodes overlapped (the CUDA default), the reference
    one round at a time."""
    return (_engine(tiny_ckpt, speculative="none", overlap_decode=True),
            _engine(tiny_ckpt, speculative="none", overlap_decode=False))


def run(coro, timeout=60):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def assert_clean(ae: AsyncEngine, eng: Engine):
    assert ae.num_unfinished() == 0
    assert not eng.requests
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert not eng.has_unfinished()
    cache = _find_cache(eng)              # the paged KV cache, once the engine has one
    if cache is not None and hasattr(cache, "num_blocks"):
        assert cache.num_free_pages == cache.num_blocks
    st = ae.stats()
    assert st["active_requests"] == 0 and st["running_requests"] == 0 and st["queue_depth"] == 0
    assert st["pages_in_use"] in (None, 0)


async def wait_idle(ae: AsyncEngine, eng: Engine, timeout=10.0):
    """Aborts are processed asynchronously by the loop thread: wait (bounded) until it is idle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ae.num_unfinished() == 0 and not eng.requests and not eng.has_unfinished():
            st = ae.stats()
            if st["queue_depth"] == 0 and st["running_requests"] == 0:
                return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not become idle")


def test_concurrent_streams_with_random_aborts(engines):
    _concurrent_streams_with_random_aborts(*engines)


def test_concurrent_streams_with_random_aborts_overlapped_decode(overlap_engines):
    """The same traffic on an engine whose decode steps run one round ahead (streams see each
    round's tokens one step() later; aborts land while a request's row is in flight)."""
    eng, _ = overlap_engines
    _concurrent_streams_with_random_aborts(*overlap_engines)
    assert eng.overlap.rounds > 0


def _concurrent_streams_with_random_aborts(eng, ref):
    rng = random.Random(1234)
    V, N = eng.cfg.vocab_size, 24
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(N)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(3, 12),
                             ignore_eos=rng.random() < 0.7) for _ in range(N)]
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    modes = [rng.choice(["stream", "stream", "generate", "break", "close", "cancel", "abort"])
             for _ in range(N)]
    cut = [rng.randint(1, 3) for _ in range(N)]
    delay = [rng.random() * 0.05 for _ in range(N)]
    cancel_after = [0.05 + rng.random() * 0.2 for _ in range(N)]

    async def one(i, ae):
        """Returns (mode, streamed token ids, final output or None)."""
        mode, seen, final = modes[i], [], None
        await asyncio.sleep(delay[i])                          # staggered arrivals
        if mode == "generate":
            out = await ae.generate(prompts[i], params[i])
            assert out.finished and out.request_id.startswith("req-")
            return mode, list(out.token_ids), out
        # "stream"/"break": the async-generator API (leaving early closes it, which aborts);
        # "cancel": the generator, cancelled from outside while it waits for tokens;
        # "abort"/"close": a RequestStream, aborted by id or closed after `cut` tokens
        if mode in ("stream", "break", "cancel"):
            rs, source = None, ae.stream(prompts[i], params[i], request_id=f"r{i}")
        else:
            rs = source = await ae.add_request(prompts[i], params[i], request_id=f"r{i}")
        async with contextlib.aclosing(source) if rs is None else contextlib.nullcontext():
            async for out in source:
                assert out.request_id == f"r{i}"               # nobody sees another's tokens
                assert out.prompt_token_ids == prompts[i]
                seen += out.new_token_ids
                assert out.token_ids == seen                   # cumulative == sum of deltas
                if out.finished:
                    final = out
                    break
                if len(seen) >= cut[i] and mode == "break":
                    break
                if len(seen) >= cut[i] and mode == "close":
                    rs.close()
                    break
                if len(seen) >= cut[i] and mode == "abort":
                    try:
                        await ae.abort(rs.request_id)
                    except ValueError:                         # it finished meanwhile: fine
                        pass
                    mode = "aborted"
        return mode, seen, final

    async def bad_requests(ae):
        """Interleaved bad input: each raises ValueError and the loop keeps serving."""
        errors = []
        long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        dup = await ae.add_request([1, 2, 3], long, request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            await ae.add_request([1, 2], SamplingParams(max_tokens=2), request_id="dup")
        dup.close()
        for prompt, sp, rid, match in [
                ([], None, None, "empty prompt"),
                (list(range(MAX_LEN)), None, None, "max_model_len"),
                ([1, 2], dict(temperature=-1.0), None, "temperature"),
                ([1, 2], dict(top_p=0.0), None, "top_p"),
                ([1, V + 5], None, None, "outside the vocabulary"),
                ("text", None, None, "tokenizer"),
                ([1, 2], SamplingParams(stop_token_ids=(V,)), None, "stop_token_ids"),
                (None, None, None, "prompt must be"),
                ([1, 2], "greedy", None, "SamplingParams")]:
            await asyncio.sleep(0.01)
            with pytest.raises(ValueError, match=match) as ei:
                # bad SamplingParams are refused when constructed
                sp = SamplingParams(**sp) if isinstance(sp, dict) else sp
                await ae.add_request(prompt, sp, request_id=rid)
            errors.append(str(ei.value))
        with pytest.raises(ValueError, match="unknown request id"):
            await ae.abort("no-such-request")
        return errors

    async def cancel_later(task, i):
        # cancel the consuming task itself while it waits for tokens
        await asyncio.sleep(cancel_after[i])
        task.cancel()

    async def main():
        async with AsyncEngine(eng) as ae:
            tasks = [asyncio.ensure_future(one(i, ae)) for i in range(N)]
            cancellers = [asyncio.ensure_future(cancel_later(t, i))
                          for i, t in enumerate(tasks) if modes[i] == "cancel"]
            bad = asyncio.ensure_future(bad_requests(ae))
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*cancellers)
            errors = await bad
            await wait_idle(ae, eng)
            assert_clean(ae, eng)
            # the loop survived everything: a fresh request still matches the reference
            out = await ae.generate(prompts[0], params[0])
            assert out.token_ids == expected[0]
            await wait_idle(ae, eng)
            stats = ae.stats()
        return results, errors, stats

    results, errors, stats = run(main())
    assert len(errors) == 9
    n_full = n_partial = 0
    for i, res in enumerate(results):
        if isinstance(res, asyncio.CancelledError):
            assert modes[i] == "cancel"
            continue
        assert not isinstance(res, BaseException), (i, modes[i], res)
        mode, seen, final = res
        if final is not None and final.finish_reason != "abort":
            assert seen == expected[i], (i, mode)              # streamed == non-streamed
            assert final.finish_reason in ("stop", "length")
            n_full += 1
        else:
            assert mode in ("break", "close", "aborted", "cancel")
            assert seen == expected[i][:len(seen)]             # a prefix of the full answer
            if final is not None:
                assert mode == "aborted" and final.token_ids == seen
            n_partial += 1
    assert n_full >= 5 and n_partial >= 3
    assert sum(stats["requests_total"].values()) >= N - modes.count("cancel")


def test_cancel_during_admission_and_shutdown_with_requests_in_flight(engines):
    eng, _ = engines

    async def main():
        ae = AsyncEngine(eng).start()
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        # a consumer cancelled right away (possibly before the loop admitted its request)
        for _ in range(3):
            t = asyncio.ensure_future(ae.generate([3, 4, 5], sp))
            await asyncio.sleep(0)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
        await wait_idle(ae, eng)
        assert_clean(ae, eng)
        # shutdown with streams in flight: every stream ends (abort or finished), none hangs
        streams = [await ae.add_request([7, 8, i + 1], sp) for i in range(4)]
        first = [await rs.__anext__() for rs in streams]
        assert all(not o.finished for o in first)
        await ae.shutdown()
        for rs in streams:
            outs = [o async for o in rs]
            assert outs and outs[-1].finished and outs[-1].finish_reason in ("abort", "length")
        assert not ae.running and ae.error is None
        with pytest.raises(EngineDeadError):
            await ae.generate([1, 2], sp)
        assert not eng.requests and not eng.has_unfinished()

    run(main())


def test_abort_by_id_ends_the_stream(engines, monkeypatch):
    """Steps are gated so the interleaving is exact: abort lands after the second step."""
    import threading
    eng, ref = engines
    gate, real_step = threading.Semaphore(0), eng.step

    def gated_step():
        assert gate.acquire(timeout=20)
        return real_step()

    monkeypatch.setattr(eng, "step", gated_step)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = ref.generate([4, 5, 6], sp).token_ids

    async def main():
        async with AsyncEngine(eng) as ae:
            rs = await ae.add_request([4, 5, 6], sp, request_id="victim")
            gate.release()                                   # step 1: prefill -> first token
            first = await rs.__anext__()
            assert first.new_token_ids == expected[:1] and not first.finished
            await ae.abort("victim")                         # queued behind step 2
            gate.release()
            rest = [o async for o in rs]
            assert rest[-1].finished and rest[-1].finish_reason == "abort"
            assert rest[-1].token_ids == expected[:len(rest[-1].token_ids)]
            assert len(rest[-1].token_ids) == 1 + sum(len(o.new_token_ids) for o in rest)
            with pytest.raises(ValueError, match="unknown request id"):
                await ae.abort("victim")                     # finished requests are unknown
            await wait_idle(ae, eng)
            assert_clean(ae, eng)
            assert ae.stats()["requests_total"].get("abort", 0) >= 1
            gate.release(100)

    run(main())


def test_step_error_reaches_waiters_and_loop_recovers(engines, monkeypatch):
    eng, ref = engines
    calls = {"n": 0}
    real_step = eng.step

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    monkeypatch.setattr(eng, "step", flaky_step)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[9, 8, 7], [1, 2, 3, 4], [5]]

    async def main():
        async with AsyncEngine(eng) as ae:
            res = await asyncio.gather(*[ae.generate(p, sp) for p in prompts],
                                       return_exceptions=True)
            assert all(isinstance(r, EngineError) for r in res), res
            assert "simulated kernel failure" in str(res[0])
            assert isinstance(res[0].original, RuntimeError)
            await wait_idle(ae, eng)
            assert_clean(ae, eng)
            assert ae.running
            # the loop keeps serving, and results are unaffected
            outs = await asyncio.gather(*[ae.generate(p, sp) for p in prompts])
            assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, sp)]
            st = ae.stats()
            assert st["step_errors_total"] == 1 and st["requests_total"]["error"] == 3

    run(main())


def test_unrecoverable_failure_shuts_down_and_reports(engines, monkeypatch):
    eng, _ = engines

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng, "step", broken_step)
    sp = SamplingParams(temperature=0, max_tokens=4)

    async def main():
        ae = AsyncEngine(eng, max_consecutive_failures=2).start()
        for _ in range(2):
            with pytest.raises(EngineError, match="device lost"):
                await ae.generate([1, 2, 3], sp)
        deadline = time.monotonic() + 10
        while ae.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not ae.running and isinstance(ae.error, RuntimeError)
        with pytest.raises(EngineDeadError, match="device lost"):
            await ae.generate([1, 2, 3], sp)
        assert ae.stats()["running"] is False
        await ae.shutdown()                     # idempotent after a fatal stop
        assert not eng.requests and not eng.has_unfinished()

    run(main())
