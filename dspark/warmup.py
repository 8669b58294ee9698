"""Engine warm-up: pay one-time costs before traffic arrives instead of in the first requests.

On a GPU the first step of a new shape costs far more than the step itself: Triton compiles a
kernel per specialisation (integer arguments are specialised on == 1 and on divisibility by 16,
and some block sizes follow the next power of two of the token count), and every CUDA-graph bucket
(batch size x query length x pages) is captured on first use. Measured on an H200 with a cold
compile cache: a batch-1 prefill of the shipped pair took 1.1-1.5 s per new prompt length instead
of ~30-45 ms. `warm_up(engine)` runs short dummy requests that cover those shapes:

* prompt lengths 1, 2, 3 and every power of two p and p + 1 up to the longest chunk one step
  prefills (`max_num_batched_tokens`, bounded by the model length), each generating a few rounds
  greedily and at temperature 1 (argmax vs fused sampling kernels);
* batches of every power of two up to `max_num_seqs` short requests at once;
* then every CUDA graph a round can replay, captured on padding rows (`ModelRunner.capture_graphs`:
  the target's batch x verify width x page buckets, the draft pass and context writes of every
  batch bucket), so that no request of traffic pays a capture.

Dummy requests go through the public API (add_request / step) and are finished before it
returns; the engine must be idle (no request added yet) so nothing of a user's request is
touched. Triton's on-disk cache makes a second process's warm-up much faster.
"""
from __future__ import annotations

import time

from .sampling import SamplingParams


def default_prompt_lengths(limit: int) -> list:
    """1, 2, 3, then p and p + 1 for every power of two p, all <= limit."""
    lens = {n for n in (1, 2, 3) if n <= limit}
    p = 4
    while p <= limit:
        lens.update(n for n in (p, p + 1) if n <= limit)
        p *= 2
    return sorted(lens)


def default_batch_sizes(max_num_seqs: int) -> list:
    sizes, b = [], 2
    while b <= max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes


def warm_up(engine, prompt_lengths=None, batch_sizes=None, rounds: int = 3,
            progress: bool = False) -> dict:
    """Run the dummy requests (module docstring) on an idle `engine`. Returns {"requests",
    "seconds", "prompt_lengths", "batch_sizes"}. prompt_lengths / batch_sizes override the
    defaults ([] skips that part)."""
    if engine.has_unfinished() or engine.requests:
        raise RuntimeError("warm_up() needs an idle engine: call it before adding requests")
    gamma = engine.drafter.gamma if engine.drafter is not None else 1
    new_tokens = rounds * (gamma + 1)
    longest = min(engine.scheduler.max_tokens, engine.max_model_len - new_tokens - 1)
    if longest < 1:
        raise ValueError(f"max_model_len={engine.max_model_len} leaves no room for a warm-up "
                         f"request of {new_tokens} new tokens")
    lens = default_prompt_lengths(longest) if prompt_lengths is None else \
        [int(n) for n in prompt_lengths if 1 <= int(n) <= longest]
    limit = engine.scheduler.max_num_seqs
    sizes = default_batch_sizes(limit) if batch_sizes is None else \
        [int(b) for b in batch_sizes if 1 <= int(b) <= limit]
    vocab = engine.cfg.vocab_size
    temps = (0.0, 1.0)

    def prompt(n: int, salt: int) -> list:
        return [(7 * i + 3 + salt) % vocab for i in range(n)]

    jobs = [[(prompt(n, 0), t)] for n in lens for t in temps]
    jobs += [[(prompt(16, j), t) for j in range(b)] for b in sizes for t in temps]
    t0, count = time.perf_counter(), 0
    from tqdm import tqdm
    for batch in tqdm(jobs, desc="warm-up", unit="batch", disable=not progress):
        ids = [engine.add_request(p, SamplingParams(temperature=t, max_tokens=new_tokens,
                                                    ignore_eos=True, seed=i))
               for i, (p, t) in enumerate(batch)]
        count += len(ids)
        while engine.has_unfinished():
            engine.step()
    graphs = {}
    capture = getattr(engine.runner, "capture_graphs", None)
    if capture is not None:
        graphs = capture(_verify_widths(engine), engine.max_model_len + gamma + 1, progress)
    return {"requests": count, "seconds": time.perf_counter() - t0, "prompt_lengths": lens,
            "batch_sizes": sizes, "graphs": graphs}


def _verify_widths(engine) -> set | None:
    """Tokens per request of the uniform steps the engine runs: 1 without a drafter, the fixed
    policy's ℓ + 1, else any of 1 .. γ + 1 (the scheduled policies' width, 0 .. γ, changes from
    round to round with the load and the confidences); None (every width the target graphs
    hold) in deterministic mode."""
    if getattr(getattr(engine, "runner", None), "deterministic", False):
        return None                      # (its prompts run as uniform steps of every width)
    if engine.drafter is None:
        return {1}
    gamma = engine.drafter.gamma
    fixed = engine.policy.host_lengths(1, gamma) if engine.policy is not None else None
    return {fixed[0] + 1} if fixed is not None else set(range(1, gamma + 2))
