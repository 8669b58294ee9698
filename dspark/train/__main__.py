"""`python -m dspark.train <command> ...`

  data      corpus -> tokenizer + token streams + held-out prompts   (dspark.train.data)
  target    train the target                                           (dspark.train.target)
  sample    on-policy rows: train windows continued by the target at T=1 (dspark.train.sample)
  drafter   train the DSpark drafter (+ no-Markov ablation)            (dspark.train.drafter)
  evaluate  τ greedy / T=1 on held-out prompts                         (dspark.train.evaluate)
  report    TRAINING.md + loss_curves.png from a results.json           (dspark.train.report)
  all       target -> [sample] -> drafter -> evaluate with time budgets, collecting the
            shipped files and one results.json in --out (what the GPU run does); with
            --second-device the sampling is split over two GPUs and the no-Markov ablation
            trains there, concurrently, in a child process
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def _child(module: str, args: list, log_path: str) -> subprocess.Popen:
    """`python -m dspark.train.<module> args` in a child process, output to log_path."""
    f = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", f"dspark.train.{module}", *map(str, args)],
                            stdout=f, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log_path: str, what: str, log) -> None:
    rc = proc.wait()
    with open(log_path) as f:
        tail = f.read().splitlines()[-3:]
    for line in tail:
        log(f"  [{what}] {line}")
    if rc:
        raise RuntimeError(f"{what} child failed (exit {rc}); its log: {log_path}")


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
    p.add_argument("--sample-time", type=float, default=0.0,
                   help="seconds of on-policy sampling from the target before the drafter (0 = off)")
    p.add_argument("--sampled-frac", type=float, default=0.25)
    p.add_argument("--sample-prompt-len", type=int, default=384)
    p.add_argument("--init-from", help="continue: start the drafter from this checkpoint's mtp.* "
                                       "(the target stays --skip-target's)")
    p.add_argument("--init-ablation", help="continue: start the no-Markov ablation from this .pt")
    p.add_argument("--device", help="main device (default: cuda if available)")
    p.add_argument("--second-device", help="e.g. cuda:1: half the sampling and the no-Markov "
                                           "ablation run there concurrently")
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
    sampled = None
    if a.sample_time > 0:
        from .sample import merge_rows, sample_rows, save_rows
        sampled = os.path.join(a.work, "sampled.npy")
        parts, child = [os.path.join(a.work, "sampled_0.npy")], None
        new = a.seq_len - a.sample_prompt_len
        meta = {"ckpt": tdir, "prompt_len": a.sample_prompt_len, "new": new}
        if a.second_device:
            parts.append(os.path.join(a.work, "sampled_1.npy"))
            child = _child("sample", ["--ckpt", tdir, "--data", a.data, "--out", parts[1],
                                      "--time-budget", a.sample_time, "--prompt-len",
                                      a.sample_prompt_len, "--new", new, "--seed", a.seed + 1,
                                      "--device", a.second_device],
                           os.path.join(a.work, "sample_1.log"))
        t_s = time.time()
        arr = sample_rows(tdir, data, time_budget=a.sample_time, prompt_len=a.sample_prompt_len,
                          new=new, seed=a.seed, device=a.device, log=log)
        save_rows(parts[0], arr, dict(meta, seed=a.seed, seconds=round(time.time() - t_s, 1)))
        if child:
            _wait(child, os.path.join(a.work, "sample_1.log"), "sample on " + a.second_device, log)
        arr, smeta = merge_rows(parts, sampled)
        results["sampled"] = {"rows": int(arr.shape[0]), "row_len": int(arr.shape[1]),
                              "prompt_len": a.sample_prompt_len, "new": new,
                              "sampled_tokens": int(arr.shape[0]) * new,
                              "seconds": round(time.time() - t_s, 1),
                              "devices": [a.device or "default"] + ([a.second_device] if child else [])}
        log(f"sampled {arr.shape[0]} rows x {new} tokens from the target at T=1")
        write_json(res_path, results)
    cdir = os.path.join(a.work, "ckpt")
    child = None
    common = dict(steps=a.drafter_steps, time_budget=a.drafter_time, batch=a.drafter_batch,
                  seq_len=a.seq_len, anchors=a.anchors, lr=a.drafter_lr, markov_rank=a.markov_rank,
                  seed=a.seed, updates_per_batch=a.updates_per_batch, sampled=sampled,
                  sampled_frac=a.sampled_frac, init_from=a.init_from, init_ablation=a.init_ablation)
    if a.second_device:      # the ablation: same seed -> same batches, its own GPU
        adir = os.path.join(a.work, "ablation")
        args = ["--data", a.data, "--target", tdir, "--out", adir, "--ablation-only",
                "--device", a.second_device]
        for k, v in common.items():
            if v is not None:
                args += [f"--{k.replace('_', '-')}", v]
        child = _child("drafter", args, os.path.join(a.work, "ablation.log"))
    dlog = train_drafter(data, tdir, cdir, ablation=child is None, device=a.device, log=log,
                         **common)
    if child:
        _wait(child, os.path.join(a.work, "ablation.log"), "ablation on " + a.second_device, log)
        shutil.copy(os.path.join(adir, "ablation.pt"), os.path.join(cdir, "ablation.pt"))
        with open(os.path.join(adir, "drafter_log.json")) as f:
            alog = json.load(f)
        dlog["train"]["no_markov"] = alog["train"]["no_markov"]
        dlog["params"]["no_markov"] = alog["params"]["no_markov"]
        dlog["final_no_markov"] = dict(alog["final"], device=a.second_device)
    results["drafter"] = dlog
    for fn in os.listdir(cdir):
        if fn.endswith(".safetensors") or fn in ("model.safetensors.index.json", "config.json"):
            shutil.copy(os.path.join(cdir, fn), os.path.join(a.out, fn))
    shutil.rmtree(os.path.join(a.out, "target"), ignore_errors=True)
    write_json(res_path, results)
    log("evaluating")
    ev = evaluate(cdir, data, os.path.join(cdir, "ablation.pt"), max_new=a.max_new, device=a.device,
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
