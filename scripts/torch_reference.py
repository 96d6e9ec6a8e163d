#!/usr/bin/env python3
"""A plain PyTorch GPT-2 training step of the shape of a pipewright model JSON, timed on one GPU.

What it measures
----------------
Training throughput of ONE optimizer step per iteration on ONE CUDA GPU, for the model described
by a pipewright model file (models/presets/*.json: layers, hidden, heads, ffn, seq_len, vocab,
max_positions, tied_embeddings, bias), with a global batch of --batch sequences of --seq-len tokens
(default: the model's seq_len). One step = forward + cross-entropy loss + backward + AdamW update
+ zeroing the gradients (set to None), on one fixed batch of random token ids (no data loading,
no gradient accumulation, no recomputation, no gradient clipping, no loss scaling).

- Model: GPT-2 (pre-LN): token embedding + learned position embedding; per block LayerNorm
  (eps 1e-5) -> qkv Linear -> causal attention -> projection Linear -> residual add -> LayerNorm
  -> Linear(C, F) -> GELU (tanh approximation, as pipewright's exec/cpu and exec/cuda kernels)
  -> Linear(F, C) -> residual add; final LayerNorm; LM head without bias, tied to the token
  embedding when the JSON says tied_embeddings; mean cross-entropy over all B*T tokens. No
  dropout. Random weights (normal, std 0.02; LayerNorm 1 and 0), random tokens: no downloads.
- Precision: fp32 parameters (the master weights), forward and backward under
  torch.autocast("cuda", dtype=torch.bfloat16): matmuls in bf16 with fp32 accumulation; autocast
  runs LayerNorm and the loss in fp32, so the residual stream is fp32. The attention softmax is
  asked for a bf16 output (its arithmetic is fp32 inside the kernel), as pipewright keeps it.
- Attention: by default plain matmuls + softmax, unfused, like pipewright: S = (q / sqrt(hd)) k^T
  over the full T x T, the causal mask filled with -inf, P = softmax(S) kept for backward,
  y = P v. --sdpa uses torch.nn.functional.scaled_dot_product_attention(is_causal=True) instead
  (fused / flash kernels); --both runs the two, one after the other, and reports each.
- Optimizer: torch.optim.AdamW(lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight_decay 0), pipewright
  train's defaults, with fused=False (PyTorch then picks its default multi-tensor "foreach"
  implementation for CUDA tensors) unless --fused.
- Eager by default; --compile wraps the model in torch.compile (the compilation happens in the
  warm-up steps, which are not timed).
- Timing: --warmup untimed steps, then --steps timed steps, each bracketed by
  torch.cuda.synchronize() and time.perf_counter(). step_time_s is the MEAN of the timed steps
  (pipewright's iteration_time_s is also a mean, of its steps after the first); the median is
  reported too. tokens_per_s = batch * seq_len / step_time_s.
- MFU: model FLOPs per token x tokens/s / the GPU's dense bf16 peak. The peak is --peak-flops, or
  peak_fp16_flops_per_s of --device-spec (clusters/devices/NAME.json; pipewright's presets give
  one figure for fp16 and bf16), or that of the device preset matching
  torch.cuda.get_device_name() (H100 SXM, H200, A100, V100); without a match MFU is null.
- Model FLOPs: the SAME count as pipewright's models::derive_costs (models/model.cpp,
  docs/formulas.md section 2), forward + backward, recomputation not counted, the causal mask not
  used to halve attention:
      flops_per_token = 6 * (L * (4*C*C + 2*C*F) + C*V) + 12 * L * T * C
  with L layers, C hidden, F ffn, V vocab, T the sequence length. That is 6 x (the weight-matrix
  elements of the blocks and the LM head; the head counts even when tied; biases, LayerNorms and
  the position table are left out) plus 12*L*T*C for Q K^T and P V (forward 4*T*C per token per
  layer, backward twice that).
- Memory: torch.cuda.max_memory_allocated() over the whole run (weights, gradients, AdamW state,
  activations, workspace of PyTorch's caching allocator; the statistics are reset before the model
  is built), and max_memory_reserved() (what the caching allocator held from the driver).

Output: one human line per run on standard output; with --json FILE a JSON object
{"format": "pipewright.torch-reference/1", "model", "shape", "parameters", "flops_per_token",
 "device", "peak_flops_per_s", "peak_source", "torch", "runs": [{"attention", "compile",
 "optimizer", "batch", "seq_len", "tokens_per_step", "warmup_steps", "timed_steps", "step_time_s",
 "median_step_time_s", "step_times_s", "tokens_per_s", "samples_per_s", "model_flops_per_s", "mfu",
 "peak_memory_bytes", "peak_reserved_bytes", "losses", "error"}]} (error is null, or why the run
failed, e.g. "out of memory"; its figures are then null). Exit status: 0 when every run
succeeded, 1 when one failed, 2 for bad arguments or no CUDA device.

Example: python3 scripts/torch_reference.py --model gpt2-124m --batch 16 --steps 20 --json t.json
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die(msg):
    print(f"torch_reference: {msg}", file=sys.stderr)
    sys.exit(2)


def load_model_json(arg):
    """A model JSON path, or a preset name (models/presets/NAME.json in this repository)."""
    path = arg if os.path.isfile(arg) else os.path.join(REPO, "models", "presets", arg + ".json")
    if not os.path.isfile(path):
        die(f"--model {arg}: neither a file nor a preset in models/presets/")
    with open(path) as f:
        spec = json.load(f)
    if spec.get("format") != "pipewright.model/1":
        die(f"{path}: /format: expected \"pipewright.model/1\", found {spec.get('format')!r}")
    for field in ("layers", "hidden", "heads", "ffn", "seq_len", "vocab"):
        if not isinstance(spec.get(field), int) or spec[field] < 1:
            die(f"{path}: /{field}: a positive integer is needed, found {spec.get(field)!r}")
    wanted = {"arch": "gpt", "mlp": "gelu", "norm": "layernorm", "positions": "learned"}
    for field, value in wanted.items():
        if spec.get(field, value) != value:
            die(f"{path}: /{field}: {spec[field]!r} is not supported here (GPT-2 style only: "
                f"{field} = {value!r})")
    if spec["hidden"] % spec["heads"]:
        die(f"{path}: /heads: hidden {spec['hidden']} is not divisible by heads {spec['heads']}")
    spec.setdefault("max_positions", spec["seq_len"])
    spec.setdefault("tied_embeddings", True)
    spec.setdefault("bias", True)
    spec.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    spec["_path"] = path
    return spec


def flops_per_token(spec, T):
    """pipewright's model FLOPs (models::derive_costs, docs/formulas.md section 2) per token."""
    L, C, F, V = spec["layers"], spec["hidden"], spec["ffn"], spec["vocab"]
    return 6.0 * (L * (4.0 * C * C + 2.0 * C * F) + C * V) + 12.0 * L * T * C


def expected_parameters(spec):
    """Parameter count as models::derive_costs counts it (the tied head counted once)."""
    L, C, F, V = spec["layers"], spec["hidden"], spec["ffn"], spec["vocab"]
    bias = 1 if spec["bias"] else 0
    block = 2 * 2 * C + (3 * C * C + bias * 3 * C) + (C * C + bias * C) + (C * F + bias * F) + (
        F * C + bias * C)
    head = 2 * C + (0 if spec["tied_embeddings"] else V * C)
    return V * C + spec["max_positions"] * C + L * block + head


def device_peak(args, torch):
    """(peak FLOP/s, where it came from) for MFU; (None, why) when unknown."""
    if args.peak_flops:
        return args.peak_flops, "--peak-flops"
    name = args.device_spec
    if not name:
        gpu = torch.cuda.get_device_name(0)
        mem = torch.cuda.get_device_properties(0).total_memory
        g = gpu.upper()
        if "H200" in g:
            name = "H200"
        elif "H100" in g and ("SXM" in g or "HBM3" in g):
            name = "H100-SXM"
        elif "A100" in g:
            name = "A100-80GB" if mem > 50e9 else "A100-40GB"
        elif "V100" in g:
            name = "V100-32GB" if mem > 20e9 else "V100-16GB"
        else:
            return None, f"no device preset matches {gpu!r} (give --peak-flops or --device-spec)"
    path = name if os.path.isfile(name) else os.path.join(REPO, "clusters", "devices",
                                                          name + ".json")
    if not os.path.isfile(path):
        die(f"--device-spec {name}: neither a file nor a preset in clusters/devices/")
    with open(path) as f:
        dev = json.load(f)
    return float(dev["peak_fp16_flops_per_s"]), f"{os.path.relpath(path, REPO)} peak_fp16_flops_per_s"


def build_model(spec, T, attention, torch):
    nn, F = torch.nn, torch.nn.functional
    L, C, NH, FF, V = spec["layers"], spec["hidden"], spec["heads"], spec["ffn"], spec["vocab"]
    hd = C // NH
    bias = bool(spec["bias"])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=1e-5)
            self.c_attn = nn.Linear(C, 3 * C, bias=bias)
            self.attn_proj = nn.Linear(C, C, bias=bias)
            self.ln_2 = nn.LayerNorm(C, eps=1e-5)
            self.c_fc = nn.Linear(C, FF, bias=bias)
            self.mlp_proj = nn.Linear(FF, C, bias=bias)
            # True above the diagonal: the positions a token must not see.
            self.register_buffer("future", torch.ones(T, T, dtype=torch.bool).triu(1),
                                 persistent=False)

        def attend(self, x):
            B = x.shape[0]
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q = q.view(B, T, NH, hd).transpose(1, 2)
            k = k.view(B, T, NH, hd).transpose(1, 2)
            v = v.view(B, T, NH, hd).transpose(1, 2)
            if attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q * (1.0 / math.sqrt(hd))) @ k.transpose(-2, -1)  # (B, NH, T, T), full
                s = s.masked_fill(self.future, float("-inf"))
                # Under autocast s is bf16: a bf16 P (fp32 math inside), not autocast's fp32.
                p = F.softmax(s, dim=-1, dtype=s.dtype)
                y = p @ v
            return self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))

        def forward(self, x):
            x = x + self.attend(x)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(spec["max_positions"], C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C, eps=1e-5)
            self.lm_head = nn.Linear(C, V, bias=False)
            if spec["tied_embeddings"]:
                self.lm_head.weight = self.wte.weight
            self.register_buffer("pos", torch.arange(T), persistent=False)
            for name, p in self.named_parameters():
                if (name.startswith("ln") or ".ln_" in name) and name.endswith("weight"):
                    nn.init.ones_(p)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02)

        def forward(self, tokens, targets):
            x = self.wte(tokens) + self.wpe(self.pos)
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    return GPT()


def run_one(spec, args, attention, torch):
    """Builds, warms up and times one configuration; a dict of results (error set on failure)."""
    T, B = args.seq_len, args.batch
    result = {"attention": attention, "compile": args.compile,
              "optimizer": "adamw fused" if args.fused else "adamw (fused=False)",
              "batch": B, "seq_len": T, "tokens_per_step": B * T,
              "warmup_steps": args.warmup, "timed_steps": args.steps, "error": None}
    for k in ("step_time_s", "median_step_time_s", "tokens_per_s", "samples_per_s",
              "model_flops_per_s", "mfu", "peak_memory_bytes", "peak_reserved_bytes"):
        result[k] = None
    result["step_times_s"], result["losses"] = [], []
    gc.collect()  # the previous run's model and optimizer, before the peak is reset
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(args.seed)
    try:
        model = build_model(spec, T, attention, torch).cuda()
        result["parameters"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.0, fused=bool(args.fused))
        step_model = torch.compile(model) if args.compile else model
        tokens = torch.randint(0, spec["vocab"], (B, T), device="cuda")
        targets = torch.randint(0, spec["vocab"], (B, T), device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_model(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step()
            torch.cuda.synchronize()
            result["step_times_s"].append(time.perf_counter() - t0)
            result["losses"].append(float(loss.item()))
    except torch.cuda.OutOfMemoryError:
        result["error"] = "out of memory"
    except Exception as e:  # e.g. a compile failure: report it, go on with the next run
        text = str(e).strip()
        result["error"] = ("out of memory" if "out of memory" in text.lower() else
                           f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
    result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    if result["error"] is None:
        times = result["step_times_s"]
        result["step_time_s"] = statistics.fmean(times)
        result["median_step_time_s"] = statistics.median(times)
        result["tokens_per_s"] = B * T / result["step_time_s"]
        result["samples_per_s"] = B / result["step_time_s"]
    return result


def main():
    p = argparse.ArgumentParser(
        description="Time a plain PyTorch GPT-2 training step of a pipewright model's shape on "
                    "one GPU (bf16 autocast, fp32 master weights, AdamW). See the docstring.")
    p.add_argument("--model", required=True, help="pipewright model JSON, or a preset name")
    p.add_argument("--batch", "-b", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the model's seq_len)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    att = p.add_mutually_exclusive_group()
    att.add_argument("--sdpa", action="store_true",
                     help="scaled_dot_product_attention instead of matmul + softmax")
    att.add_argument("--both", action="store_true",
                     help="run matmul + softmax attention, then SDPA, and report both")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-flops", type=float, default=None,
                   help="the GPU's bf16 peak in FLOP/s for MFU (default: from the device preset)")
    p.add_argument("--device-spec", default=None,
                   help="device preset name or file for the peak (default: by the GPU's name)")
    p.add_argument("--json", metavar="FILE", help="write the results as a JSON object here")
    args = p.parse_args()
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        die("--batch and --steps must be at least 1, --warmup at least 0")

    spec = load_model_json(args.model)
    args.seq_len = args.seq_len or spec["seq_len"]
    if args.seq_len > spec["max_positions"]:
        die(f"--seq-len {args.seq_len} exceeds the model's max_positions {spec['max_positions']}")

    try:
        import torch
    except ImportError:
        die(f"no PyTorch in {sys.executable}")
    if not torch.cuda.is_available():
        die("no CUDA device (torch.cuda.is_available() is False)")

    peak, peak_source = device_peak(args, torch)
    fpt = flops_per_token(spec, args.seq_len)
    attentions = ["matmul", "sdpa"] if args.both else ["sdpa" if args.sdpa else "matmul"]
    runs = []
    for attention in attentions:
        r = run_one(spec, args, attention, torch)
        if r["error"] is None:
            r["model_flops_per_s"] = fpt * r["tokens_per_s"]
            r["mfu"] = r["model_flops_per_s"] / peak if peak else None
        runs.append(r)
        gib = r["peak_memory_bytes"] / 2**30
        what = (f"torch {spec['name']} b={args.batch} T={args.seq_len} "
                f"{'compiled' if args.compile else 'eager'} {attention}-attention "
                f"{'fused ' if args.fused else ''}adamw")
        if r["error"]:
            print(f"{what}: FAILED ({r['error']}), peak {gib:.2f} GiB", flush=True)
            continue
        mfu = f"MFU {100 * r['mfu']:.1f}% of {peak / 1e12:.0f} TFLOP/s" if peak else "MFU n/a"
        print(f"{what}: {r['tokens_per_s']:.0f} tok/s, step {1e3 * r['step_time_s']:.2f} ms "
              f"(median {1e3 * r['median_step_time_s']:.2f}), {mfu}, peak {gib:.2f} GiB, "
              f"loss {r['losses'][-1]:.3f}", flush=True)

    params = runs[0].get("parameters")
    if params is not None and params != expected_parameters(spec):
        print(f"torch_reference: warning: {params} parameters, pipewright counts "
              f"{expected_parameters(spec)}", file=sys.stderr)
    if args.json:
        out = {
            "format": "pipewright.torch-reference/1",
            "model": spec["name"],
            "model_file": spec["_path"],
            "shape": {k: spec[k] for k in ("layers", "hidden", "heads", "ffn", "vocab",
                                           "max_positions", "tied_embeddings", "bias")},
            "parameters": params,
            "flops_per_token": fpt,
            "device": torch.cuda.get_device_name(0),
            "peak_flops_per_s": peak,
            "peak_source": peak_source,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "runs": runs,
        }
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)
    return 0 if all(r["error"] is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
