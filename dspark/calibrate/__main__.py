"""python -m dspark.calibrate --model PATH [--dataset JSONL]

Runs the engine with full-block verification on prompts, records every round's confidence
logits and how many drafts were accepted, fits one temperature per draft position (Sequential
Temperature Scaling, spec §6.6) on half of the requests, reports ECE before/after on the other
half, and writes `dspark_sts.json` beside the checkpoint (the engine loads it automatically) plus
a reliability diagram PNG.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from tqdm import tqdm

from ..bench.datasets import load_prompts
from ..engine import Engine, default_model_path
from ..sampling import SamplingParams
from ..spec.calibrate import (STS_FILENAME, StsCalibration, cumulative_confidence, ece, fit_sts,
                              plot_reliability, prefix_accept_labels)


def collect_rounds(engine: Engine, prompts, sp: SamplingParams, progress=True):
    """(conf logits [N, γ], accepted [N], verified [N], request index [N]) over all rounds."""
    engine.round_log = []
    owner = []
    ids = [engine.add_request(p, SamplingParams(**{**sp.__dict__, "seed": i}))
           for i, p in enumerate(prompts)]
    index = {rid: i for i, rid in enumerate(ids)}
    bar = tqdm(total=len(ids), desc="calibration rounds", unit="req", disable=not progress,
               file=sys.stderr)
    while engine.has_unfinished():
        before = len(engine.round_log)
        running = [r.request_id for r in engine.scheduler.running]
        outs = engine.step()
        # rounds are logged in the order of the running requests that verified this step
        owner += [index[rid] for rid in running][: len(engine.round_log) - before]
        bar.update(sum(o.finished for o in outs))
    bar.close()
    log, engine.round_log = engine.round_log, None
    conf = torch.stack([c for c, _, _ in log]).numpy()
    verified = np.array([v for _, v, _ in log])
    accepted = np.array([a for _, _, a in log])
    return conf, accepted, verified, np.array(owner)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="DSpark checkpoint directory (default: shipped pair)")
    p.add_argument("--dataset", default=None, help="JSONL prompts (default: the model's held-out prompts)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help=f"where to write {STS_FILENAME} (default: the model dir)")
    p.add_argument("--plot", default=None, help="reliability PNG (default: beside the JSON)")
    a = p.parse_args(argv)
    model = a.model or default_model_path()
    dataset = a.dataset or os.path.join(model, "heldout_prompts.jsonl")
    prompts = load_prompts(dataset, a.num_prompts)
    engine = Engine(model, device=a.device, verify_policy="fixed")
    engine.policy.temperatures = None            # measure the raw head, whatever is on disk
    sp = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)
    conf, acc, ver, owner = collect_rounds(engine, prompts, sp)
    g = conf.shape[1]
    labels, valid = prefix_accept_labels(acc, ver, g)
    fit = owner % 2 == 0                          # split by request: no round leaks across halves
    cal = fit_sts(conf[fit], labels[fit], valid[fit], dataset=os.path.basename(dataset))
    held = ~fit
    before = cumulative_confidence(conf[held])
    after = cumulative_confidence(conf[held], cal.temperatures)
    m = valid[held]
    cal = StsCalibration(cal.temperatures,
                         [ece(before[:, k], labels[held][:, k], mask=m[:, k]) for k in range(g)],
                         [ece(after[:, k], labels[held][:, k], mask=m[:, k]) for k in range(g)],
                         int(conf.shape[0]), cal.dataset)
    out = cal.save(a.out or model)
    png = a.plot or os.path.splitext(out)[0] + "_reliability.png"
    plot_reliability((before[m], labels[held][m]), (after[m], labels[held][m]), png)
    print(f"{'pos':>4} {'T':>7} {'ECE before %':>13} {'ECE after %':>12}   (held-out half, {held.sum()} rounds)")
    for k in range(g):
        print(f"{k + 1:>4} {cal.temperatures[k]:>7.3f} {100 * cal.ece_before[k]:>13.2f} "
              f"{100 * cal.ece_after[k]:>12.2f}")
    print(f"overall ECE {100 * ece(before[m], labels[held][m]):.2f}% -> "
          f"{100 * ece(after[m], labels[held][m]):.2f}%   wrote {out} and {png}")


if __name__ == "__main__":
    main()
