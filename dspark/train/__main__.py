"""`python -m dspark.train <command> ...`

  data      corpus -> tokenizer + token streams + held-out prompts   (dspark.train.data)
  target    train the target                                           (dspark.train.target)
  drafter   train the DSpark drafter (+ no-Markov ablation)            (dspark.train.drafter)
  evaluate  τ greedy / T=1 on held-out prompts                         (dspark.train.evaluate)
  report    TRAINING.md + loss_curves.png from a results.json           (dspark.train.report)
  all       target -> drafter -> evaluate in one process with time budgets, collecting the
            shipped files and one results.json in --out (what the GPU run does)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time


def run_all(argv=None):
    from .common import write_json
    from .data import PreparedData
    from .drafter import train_drafter
    from .evaluate import evaluate
    from .target import train_target

    p = argparse.ArgumentParser(prog="python -m dspark.train all")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="collected outputs (checkpoint, results.json)")
    p.add_argument("--work", default="/tmp/dspark_train_work", help="scratch directory")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--target-time", type=float, default=270.0)
    p.add_argument("--target-steps", type=int, default=0)
    p.add_argument("--target-batch", type=int, default=128)
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--drafter-time", type=float, default=190.0)
    p.add_argument("--drafter-steps", type=int, default=0)
    p.add_argument("--drafter-batch", type=int, default=64)
    p.add_argument("--anchors", type=int, default=96)
    p.add_argument("--drafter-lr", type=float, default=2e-3)
    p.add_argument("--updates-per-batch", type=int, default=1,
                   help="drafter updates per frozen-target forward (fresh anchors each)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--max-prompts", type=int, default=0)
    p.add_argument("--greedy-check", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=300_000)
    p.add_argument("--skip-target", help="reuse this target checkpoint dir instead of training one")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    res_path = os.path.join(a.out, "results.json")
    results = {"argv": sys.argv, "args": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch
        results["env"] = {"torch": torch.__version__, "python": sys.version.split()[0],
                          "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    except Exception as e:  # pragma: no cover
        results["env"] = {"error": repr(e)}

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    data = PreparedData(a.data)
    results["data"] = {k: v for k, v in data.info.items() if k != "heldout_files_list"}
    write_json(res_path, results)

    tdir = a.skip_target or os.path.join(a.work, "target")
    if a.skip_target:
        # reuse the target's training record when the directory is a shipped model
        prev = os.path.join(a.skip_target, "training_log.json")
        if os.path.exists(prev):
            import json
            with open(prev) as f:
                old = json.load(f)
            if "target" in old:
                results["target"] = old["target"]
    else:
        tlog = train_target(data, tdir, tiny=a.tiny, steps=a.target_steps, time_budget=a.target_time,
                            batch=a.target_batch, seq_len=a.seq_len, lr=a.target_lr, seed=a.seed,
                            eval_tokens=a.eval_tokens, log=log)
        results["target"] = tlog
        write_json(res_path, results)
        # keep the target weights until the full checkpoint exists (a drafter failure leaves them)
        shutil.copytree(tdir, os.path.join(a.out, "target"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.png", "*.json.tmp", "target_log.json",
                                                      "tokenizer.json"))
    cdir = os.path.join(a.work, "ckpt")
    dlog = train_drafter(data, tdir, cdir, steps=a.drafter_steps, time_budget=a.drafter_time,
                         batch=a.drafter_batch, seq_len=a.seq_len, anchors=a.anchors, lr=a.drafter_lr,
                         markov_rank=a.markov_rank, ablation=True, seed=a.seed, log=log,
                         updates_per_batch=a.updates_per_batch)
    results["drafter"] = dlog
    for fn in os.listdir(cdir):
        if fn.endswith(".safetensors") or fn in ("model.safetensors.index.json", "config.json"):
            shutil.copy(os.path.join(cdir, fn), os.path.join(a.out, fn))
    shutil.rmtree(os.path.join(a.out, "target"), ignore_errors=True)
    write_json(res_path, results)
    log("evaluating")
    ev = evaluate(cdir, data, os.path.join(cdir, "ablation.pt"), max_new=a.max_new,
                  max_prompts=a.max_prompts, greedy_check=a.greedy_check, seed=a.seed, log=log,
                  on_result=lambda r: write_json(res_path, dict(results, eval=r)))
    results["eval"] = ev
    results["total_seconds"] = round(time.time() - t0, 1)
    write_json(res_path, results)
    log(f"done in {results['total_seconds']}s")
    return results


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "all":
        return run_all(rest)
    mods = {"data": "data", "target": "target", "drafter": "drafter", "evaluate": "evaluate",
            "report": "report"}
    if cmd not in mods:
        raise SystemExit(f"unknown command {cmd!r}; choose one of: all, {', '.join(mods)}")
    import importlib
    return importlib.import_module(f"dspark.train.{mods[cmd]}").main(rest)


if __name__ == "__main__":
    main()
