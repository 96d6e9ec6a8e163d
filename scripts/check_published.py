#!/usr/bin/env python3
"""Predicts published A100 training runs with `pipewright estimate` and prints each run's
step-time error. Nothing in pipewright is fitted to these runs: they check the device presets.

Tables (the figures are typed from the papers; docs/performance.md, "Held-out published runs"):

  narayanan-t1   Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
                 Using Megatron-LM", SC'21, Table 1: GPT 1.7B to 1T on 32 to 3,072 A100-80GB,
                 t = 1-8, p = 1-64, achieved TFLOP/s per GPU. The measured step time is the
                 paper's FLOP count 96 B s l h^2 (1 + s/6h + V/16lh) (recomputation included)
                 divided by GPUs x TFLOP/s. The table gives neither microbatch size nor schedule:
                 b = --microbatch (1) and 1F1B are assumptions; full recomputation.
  korthikanti-t5 Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
                 Models", MLSys 2023 (arXiv 2205.05198), Table 5: iteration times of GPT 22B,
                 175B, 530B and 1T (t = 8, p = 1-64, 8 to 512 A100-80GB, global batches 4, 64, 280
                 and 512, s = 2048, V = 51,200) with full recomputation and with sequence
                 parallelism + selective recomputation. Microbatch size 1 and 1F1B are
                 assumptions (the paper's iteration times match its MFU column with these
                 global batches).

  korthikanti-t4 The same paper, Table 4: one transformer layer of the 22B model (t = 8, global
                 batch 4), forward + backward time per iteration in ms with no recomputation
                 (19.6), sequence parallelism (19.0), full recomputation (27.2), selective
                 recomputation (20.9) and both (20.3). Predicted as the step's stage time with 48
                 layers minus that with 47 (one layer's forward + backward, recomputation
                 included), times the m microbatches; b = 1 (m = 4) is an assumption.

Megatron's "full recomputation" keeps each transformer layer's input and re-makes one layer at a
time: pipewright's `--recompute block` (its step time is that of `--recompute full`, the stage-level
mode, which these rows used before 2026-11-29, with the same predictions).

Both papers predate FlashAttention in Megatron-LM: attention is the unfused form (the T x T
scores are materialized), as in the calibration rows (docs/formulas.md section 8).

Usage: scripts/check_published.py [--table T] [--pipewright PW] [--device D] [--microbatch B]
                                  [--check MEAN,MAX]
--check exits 1 when the mean |error| exceeds MEAN or the max exceeds MAX (fractions).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

S, V = 2048, 51200

# name hidden heads layers t p GPUs global-batch published-TFLOP/s-per-GPU
NARAYANAN_T1 = [
    ("1.7B", 2304, 24, 24, 1, 1, 32, 512, 137),
    ("3.6B", 3072, 32, 30, 2, 1, 64, 512, 138),
    ("7.5B", 4096, 32, 36, 4, 1, 128, 512, 142),
    ("18.4B", 6144, 48, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 8192, 64, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 10240, 80, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 12288, 96, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 16384, 128, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 20480, 128, 105, 8, 35, 2520, 2520, 163),
    ("1T", 25600, 160, 128, 8, 64, 3072, 3072, 163),
]

# name hidden heads layers t p GPUs global-batch full-recompute-s sp+selective-s
KORTHIKANTI_T5 = [
    ("22B", 6144, 64, 48, 8, 1, 8, 4, 1.42, 1.10),
    ("175B", 12288, 96, 96, 8, 8, 64, 64, 18.13, 13.75),
    ("530B", 20480, 128, 105, 8, 35, 280, 280, 49.05, 37.83),
    ("1T", 25600, 160, 128, 8, 64, 512, 512, 94.42, 71.49),
]


def model_json(name, h, heads, layers):
    return {"format": "pipewright.model/1", "name": f"published-{name}", "arch": "gpt",
            "layers": layers, "hidden": h, "heads": heads, "ffn": 4 * h, "seq_len": S,
            "vocab": V, "max_positions": S, "tied_embeddings": True, "bias": True,
            "mlp": "gelu", "norm": "layernorm", "positions": "learned", "dtype": "fp16",
            "dropout": True, "attention": "unfused"}


def estimate(args, tmp, model, t, p, w, b, m, gpus, extra):
    path = os.path.join(tmp, "m.json")
    with open(path, "w") as f:
        json.dump(model, f)
    out = os.path.join(tmp, "r.json")
    cmd = [args.pipewright, "estimate", "--model", path, "--cluster",
           f"dgx-a100:{(gpus + 7) // 8}", "--set", f"device={args.device}", "--tp", str(t),
           "-d", str(p), "-w", str(w), "-b", str(b), "-m", str(m), "--schedule", "1f1b",
           "--out", out] + extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["iteration_time_s"]


def rows_narayanan(args, tmp):
    b = args.microbatch
    for name, h, heads, layers, t, p, gpus, batch, tflops in NARAYANAN_T1:
        w = gpus // (t * p)
        flops = 96 * batch * S * layers * h * h * (1 + S / (6 * h) + V / (16 * layers * h))
        measured = flops / (gpus * tflops * 1e12)
        predicted = estimate(args, tmp, model_json(name, h, heads, layers), t, p, w, b,
                             batch // (w * b), gpus, ["--recompute", "block"])
        yield name, "full", gpus, t, p, w, batch, predicted, measured


def rows_korthikanti(args, tmp):
    b = args.microbatch
    for name, h, heads, layers, t, p, gpus, batch, full_s, selective_s in KORTHIKANTI_T5:
        w = gpus // (t * p)
        model = model_json(name, h, heads, layers)
        m = batch // (w * b)
        for mode, extra, measured in (("full", ["--recompute", "block"], full_s),
                                      ("sp+selective", ["--sp", "--recompute", "selective"],
                                       selective_s)):
            predicted = estimate(args, tmp, model, t, p, w, b, m, gpus, extra)
            yield name, mode, gpus, t, p, w, batch, predicted, measured


# mode name, flags, published forward + backward ms of one layer per iteration (22B, t = 8, B = 4)
KORTHIKANTI_T4 = [
    ("none", ["--recompute", "none"], 19.6),
    ("sp", ["--sp", "--recompute", "none"], 19.0),
    ("full", ["--recompute", "block"], 27.2),
    ("selective", ["--recompute", "selective"], 20.9),
    ("sp+selective", ["--sp", "--recompute", "selective"], 20.3),
]


def layer_ms(args, tmp, layers, b, m, extra):
    """Forward + backward of the one stage with `layers` layers, ms per iteration."""
    path = os.path.join(tmp, "m.json")
    with open(path, "w") as f:
        json.dump(model_json("22B", 6144, 64, layers), f)
    out = os.path.join(tmp, "r.json")
    subprocess.run([args.pipewright, "estimate", "--model", path, "--cluster", "dgx-a100:1",
                    "--set", f"device={args.device}", "--tp", "8", "-d", "1", "-w", "1", "-b",
                    str(b), "-m", str(m), "--schedule", "1f1b", "--allow-oom", "--out", out] +
                   extra, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        stage = json.load(f)["estimate"]["stages"][0]
    return m * (stage["forward_s"] + stage["backward_s"]) * 1e3


def rows_korthikanti_t4(args, tmp):
    b = args.microbatch
    if 4 % b:
        sys.exit("check_published.py: korthikanti-t4: --microbatch must divide the batch of 4")
    for mode, extra, measured in KORTHIKANTI_T4:
        one = layer_ms(args, tmp, 48, b, 4 // b, extra) - layer_ms(args, tmp, 47, b, 4 // b, extra)
        yield "22B/layer", mode, 8, 8, 1, 1, 4, one / 1e3, measured / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", choices=["narayanan-t1", "korthikanti-t5", "korthikanti-t4"],
                    default="narayanan-t1")
    ap.add_argument("--pipewright", default="./build/pipewright")
    ap.add_argument("--device", default="A100-80GB-cal")
    ap.add_argument("--microbatch", type=int, default=1)
    ap.add_argument("--check", help="MEAN,MAX: exit 1 when the mean or max |error| passes them")
    args = ap.parse_args()
    if args.microbatch < 1:
        sys.exit("check_published.py: --microbatch must be >= 1")
    limits = None
    if args.check:
        try:
            limits = [float(x) for x in args.check.split(",")]
            assert len(limits) == 2 and all(0 < x < 10 for x in limits)
        except (ValueError, AssertionError):
            sys.exit(f"check_published.py: --check: expected MEAN,MAX fractions, found {args.check}")
    rows = {"narayanan-t1": rows_narayanan, "korthikanti-t5": rows_korthikanti,
            "korthikanti-t4": rows_korthikanti_t4}[args.table]
    print(f"{args.table} with {args.device}, b = {args.microbatch}, 1F1B, unfused attention")
    print(f"{'model':<7} {'recompute':<13} {'GPUs':>5} {'t':>2} {'p':>3} {'w':>3} {'B':>5} "
          f"{'predicted':>10} {'measured':>10} {'error':>7}")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode, gpus, t, p, w, batch, predicted, measured in rows(args, tmp):
            e = predicted / measured - 1
            errors.append(abs(e))
            unit, scale = ("ms", 1e3) if args.table == "korthikanti-t4" else ("s", 1)
            print(f"{name:<7} {mode:<13} {gpus:>5} {t:>2} {p:>3} {w:>3} {batch:>5} "
                  f"{predicted * scale:>9.2f}{unit} {measured * scale:>9.2f}{unit} {e:>+7.1%}")
    mean, worst = sum(errors) / len(errors), max(errors)
    print(f"mean |error| {mean:.1%}, max {worst:.1%} over {len(errors)} runs")
    if limits and (mean > limits[0] or worst > limits[1]):
        print(f"check failed: the limits are mean {limits[0]:.1%}, max {limits[1]:.1%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
