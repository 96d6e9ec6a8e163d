#!/usr/bin/python3
"""The CPU executor's speed against PyTorch eager on the same shape, side by side.

What it measures
----------------
Training throughput of one optimizer step (forward + mean cross-entropy + backward + AdamW)
of a GPT-2-style model on ONE CPU thread, two ways, alternating:

- pipewright: `pipewright train --backend cpu --model M.json --schedule gpipe -d 1 -m 1 -b B
  --steps S -o report.json` (fp32, one rank = one thread; the executor sets OpenBLAS to one
  thread, and OPENBLAS_NUM_THREADS=1 / OMP_NUM_THREADS=1 are set for both sides anyway). Its
  step time is the report's iteration_time_s: the mean of the steps after the first.
- torch: this script run with --torch-only in a fresh python3 process: the same model in PyTorch
  eager (torch.set_num_threads(1)), fp32, no autocast, the same pre-LN block as exec/cpu: token +
  learned position embedding; per block LayerNorm (eps 1e-5) -> qkv Linear -> causal attention as
  plain matmuls over the full T x T (the mask filled with -inf, softmax, P @ v; unfused, as
  exec/cpu) -> projection Linear -> residual; LayerNorm -> Linear(C, F) -> GELU (tanh
  approximation, as exec/cpu) -> Linear(F, C) -> residual; final LayerNorm; LM head without bias,
  tied to the token embedding when the model says so; torch.optim.AdamW(lr 1e-3, betas (0.9,
  0.95), eps 1e-8, weight_decay 0, foreach=False) as pipewright train's defaults; gradients set
  to None after each step. Random tokens, one fixed batch. Its step time is the mean of the
  steps after the first, of --steps steps, as pipewright's.

The two runs take turns (--runs pairs, which side goes first alternating), so slow phases of a
shared machine fall on both. Printed: every run, then the medians of ms/step and tokens/s per side
and the ratio pipewright / torch of the median tokens/s, the median of the pairs' own ratios
(each pair ran back to back), and the load average before and after.

Shapes (--shape): gpt-4x256 (4 layers, hidden 256, 4 heads, ffn 1024, T 256, vocab 4096, tied;
b 8 by default) and gpt2-block (one block of GPT-2 124M's shape: hidden 768, 12 heads, ffn 3072,
T 1024; vocab 1024 so that the block, not the head, dominates; tied; b 1 by default). --model
takes any pipewright model JSON instead.

Without PyTorch (python3-torch) the torch side is skipped with a message, and the pipewright
side still runs. Exit status 0, or 2 for bad arguments / a failed run.

Example: scripts/torch_cpu_speed.py --pipewright build/pipewright --shape gpt-4x256 --runs 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    "gpt-4x256": ({"layers": 4, "hidden": 256, "heads": 4, "ffn": 1024, "seq_len": 256,
                   "vocab": 4096}, 8),
    "gpt2-block": ({"layers": 1, "hidden": 768, "heads": 12, "ffn": 3072, "seq_len": 1024,
                    "vocab": 1024}, 1),
}


def die(msg):
    print(f"torch_cpu_speed: {msg}", file=sys.stderr)
    sys.exit(2)


def model_json(name, shape):
    spec = {"format": "pipewright.model/1", "name": name, "arch": "gpt", **shape,
            "max_positions": shape["seq_len"], "type_vocab": 0, "tied_embeddings": True,
            "bias": True, "mlp": "gelu", "norm": "layernorm", "positions": "learned",
            "dtype": "fp32", "description": f"{name}: CPU speed comparison shape"}
    return spec


def single_thread_env():
    env = dict(os.environ)
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


# ----------------------------------------------------------------------------- torch side


def build_model(spec, torch):
    # The same GPT as scripts/torch_reference.py's (full T x T attention, as in eager code), at the
    # model's sequence length.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_reference import build_model as reference_model
    return reference_model(spec, spec["seq_len"], "full", torch)


def torch_only(args):
    """Runs in its own process: prints one JSON line with the step times."""
    try:
        import torch
    except ImportError:
        print(json.dumps({"error": f"no PyTorch in {sys.executable} (apt-get install "
                                   f"python3-torch)"}))
        return 0
    torch.set_num_threads(1)
    with open(args.model) as f:
        spec = json.load(f)
    torch.manual_seed(1234)
    model = build_model(spec, torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, foreach=False)
    B, T, V = args.batch, spec["seq_len"], spec["vocab"]
    tokens = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    times, losses = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        if i > 0:  # as pipewright: the mean of the steps after the first
            times.append(time.perf_counter() - t0)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "step_time_s": statistics.fmean(times), "step_times_s": times,
                      "losses": losses}))
    return 0


# ----------------------------------------------------------------------------- both sides


def run_pipewright(args, model_path, tmp):
    out = os.path.join(tmp, "report.json")
    cmd = [args.pipewright, "train", "--backend", "cpu", "--model", model_path, "--schedule",
           "gpipe", "-d", "1", "-m", "1", "-b", str(args.batch), "--steps", str(args.steps),
           "-o", out]
    p = subprocess.run(cmd, env=single_thread_env(), capture_output=True, text=True)
    if p.returncode != 0:
        die(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    with open(out) as f:
        report = json.load(f)
    return report["iteration_time_s"], cmd


def run_torch(args, model_path):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-only", "--model", model_path,
           "-b", str(args.batch), "--steps", str(args.steps)]
    p = subprocess.run(cmd, env=single_thread_env(), capture_output=True, text=True)
    if p.returncode != 0:
        die(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if "error" in r:
        return None, r["error"], cmd
    return r["step_time_s"], r["torch"], cmd


def loadavg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    p = argparse.ArgumentParser(description="pipewright's CPU executor against PyTorch eager, "
                                            "one thread each, alternating. See the docstring.")
    p.add_argument("--pipewright", default=os.path.join(REPO, "build", "pipewright"),
                   help="the pipewright binary (default: build/pipewright)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt-4x256")
    p.add_argument("--model", help="a pipewright model JSON instead of --shape")
    p.add_argument("--batch", "-b", type=int, help="sequences per step (default: the shape's)")
    p.add_argument("--steps", type=int, default=6,
                   help="steps per run; the first is not timed (default 6)")
    p.add_argument("--runs", type=int, default=5, help="runs per side (default 5)")
    p.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2 or args.runs < 1 or (args.batch is not None and args.batch < 1):
        die("--steps must be at least 2, --runs and --batch at least 1")
    if args.torch_only:
        return torch_only(args)

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_path = args.model
            with open(model_path) as f:
                spec = json.load(f)
            args.batch = args.batch or 8
        else:
            shape, batch = SHAPES[args.shape]
            spec = model_json(args.shape, shape)
            model_path = os.path.join(tmp, args.shape + ".json")
            with open(model_path, "w") as f:
                json.dump(spec, f, indent=2)
            args.batch = args.batch or batch
        if not os.access(args.pipewright, os.X_OK):
            die(f"--pipewright {args.pipewright}: not an executable (build it first)")
        tokens = args.batch * spec["seq_len"]
        print(f"{spec['name']}: layers {spec['layers']}, hidden {spec['hidden']}, heads "
              f"{spec['heads']}, ffn {spec['ffn']}, T {spec['seq_len']}, vocab {spec['vocab']}, "
              f"b {args.batch} ({tokens} tokens/step), {args.steps} steps per run, one thread; "
              f"load average {loadavg()}", flush=True)
        pw, th = [], []
        torch_missing = None
        for i in range(args.runs):
            sides = ["pipewright", "torch"] if i % 2 == 0 else ["torch", "pipewright"]
            for side in sides:
                if side == "pipewright":
                    t, cmd = run_pipewright(args, model_path, tmp)
                    pw.append(t)
                    print(f"  run {i + 1} pipewright: {1e3 * t:.1f} ms/step, "
                          f"{tokens / t:.0f} tokens/s", flush=True)
                    if i == 0:
                        print(f"    ({' '.join(cmd)})", flush=True)
                elif torch_missing is None:
                    t, what, cmd = run_torch(args, model_path)
                    if t is None:
                        torch_missing = what
                        print(f"  torch side skipped: {what}", flush=True)
                        continue
                    th.append(t)
                    print(f"  run {i + 1} torch {what}: {1e3 * t:.1f} ms/step, "
                          f"{tokens / t:.0f} tokens/s", flush=True)
                    if i == 0:
                        print(f"    ({' '.join(cmd)})", flush=True)
        pm = statistics.median(pw)
        line = (f"medians of {args.runs}: pipewright {1e3 * pm:.1f} ms/step "
                f"{tokens / pm:.0f} tokens/s")
        if th:
            tm = statistics.median(th)
            # The two runs of a pair ran back to back: their ratio is less exposed to a load
            # that changes between pairs than the ratio of the medians.
            paired = statistics.median(t / p for p, t in zip(pw, th))
            line += (f"; torch {1e3 * tm:.1f} ms/step {tokens / tm:.0f} tokens/s; "
                     f"pipewright/torch tokens/s = {tm / pm:.2f} (median of the pairs' ratios "
                     f"{paired:.2f})")
        print(f"{line}; load average {loadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
