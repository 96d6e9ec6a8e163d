#!/usr/bin/env bash
# Generates the data notebooks/offload.ipynb reads (the memory what-if of issue 15), all predicted
# by `pipewright estimate` (closed form) and, for the timeline and the bandwidth sweep,
# `pipewright simulate`:
#   capacity.csv   the largest GPT of a family (hidden 4096, 32 heads, T = 1024, vocab 50,257,
#                  L layers: about 0.2 B parameters a layer) that fits, against the node's host
#                  memory and the offload mode, on 1 and on 8 V100-32GB (v100-32gb-ws: one GPU and
#                  223.5 GiB per node; 8 GPUs = 8 such nodes on 100 Gb/s in one pipeline, d = 8), with its step time
#                  and device / host peaks. Plan: 1f1b, b = 1, m = 8 (16 on 8 GPUs), full
#                  recomputation (activation offload chooses swap or recompute per stage itself;
#                  chunks, one GPU only, run without it).
#   bandwidth.csv  gpt-10b on one V100-32GB with --offload optimizer: step time against the
#                  host link's bandwidth (PCIe 5 allowed so the sweep can pass PCIe 3's 15.75 GB/s)
#   timeline_2bw.json, report_2bw.json  a simulated 2BW plan with optimizer and activation
#                  offload: gpt3-13b on 4 GH200 nodes, d = 4, b = 2, m = 8 (its timeline has
#                  device and host memory counters per rank)
# Usage: make_offload_data.sh PATH/TO/pipewright OUT_DIR   (about 30 s on 2 cores)
set -euo pipefail
PW=$1
OUT=$2
mkdir -p "$OUT"

/usr/bin/python3 - "$PW" "$OUT" <<'PY'
import csv
import json
import os
import subprocess
import sys

pw, out = sys.argv[1:]
GIB = 2**30


def model(layers):
    path = os.path.join(out, f"gpt-h4096-l{layers}.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump({"format": "pipewright.model/1", "name": f"gpt-h4096-l{layers}",
                       "arch": "gpt", "layers": layers, "hidden": 4096, "heads": 32,
                       "ffn": 16384, "seq_len": 1024, "vocab": 50257, "max_positions": 1024,
                       "tied_embeddings": True, "dtype": "fp16"}, f)
    return path


def estimate(layers, gpus, host_gib, mode):
    report = os.path.join(out, "estimate.json")
    cmd = [pw, "estimate", "--model", model(layers), "--cluster", f"v100-32gb-ws:{gpus}",
           "--set", f"host.memory_bytes={host_gib * GIB}",
           "--set", f"host.pinned_memory_bytes={host_gib * GIB}",
           "-d", str(gpus), "-b", "1", "-m", str(8 if gpus == 1 else 16), "--schedule", "1f1b",
           "--allow-oom", "--out", report]
    if gpus > 1:  # the workstation preset has no network: 100 Gb/s Ethernet between the nodes
        cmd += ["--set", "network.bandwidth_bytes_per_s=12.5e9"]
    if mode != "none":
        cmd += ["--offload", mode]
    if "activations" not in mode and mode != "chunks":  # chunks run without recomputation
        cmd += ["--recompute", "full"]
    run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        # A chunk plan whose eviction cannot make room for a layer is an error, not a report:
        # that model does not fit. Any other error stops the script.
        if "offload chunks:" in run.stderr and "smaller than" in run.stderr:
            return {"fits": False}
        sys.exit(run.stderr.strip())
    with open(report) as f:
        r = json.load(f)
    hosts = r.get("hosts") or []
    return {"fits": r["fits"], "step_s": r["iteration_time_s"],
            "device_peak_gib": max(d["peak_memory_bytes"] for d in r["devices"]) / GIB,
            "host_peak_gib": max((h["peak_memory_bytes"] for h in hosts), default=0) / GIB}


def parameters(layers):
    text = subprocess.run([pw, "models", model(layers), "--json"], check=True,
                          capture_output=True, text=True).stdout
    return json.loads(text)["derived_per_sample"]["total_parameters"]


rows = []
for gpus in (1, 8):
    for host_gib in (64, 128, 224, 512):
        modes = ["none", "optimizer", "activations", "optimizer,activations"]
        if gpus == 1:  # PatrickStar's chunks: one GPU only so far
            modes.append("chunks")
        for mode in modes:
            # The largest L (a multiple of gpus, so stages are even) that fits: fitting is
            # monotone in L, so bisect over [gpus, 800].
            lo, hi, best = 1, 800 // gpus, None
            while lo <= hi:
                mid = (lo + hi) // 2
                e = estimate(mid * gpus, gpus, host_gib, mode)
                if e["fits"]:
                    best, lo = (mid * gpus, e), mid + 1
                else:
                    hi = mid - 1
            row = {"gpus": gpus, "host_gib": host_gib, "mode": mode, "layers": 0,
                   "parameters": 0, "step_s": "", "device_peak_gib": "", "host_peak_gib": ""}
            if best:
                layers, e = best
                row.update(layers=layers, parameters=parameters(layers),
                           step_s=f"{e['step_s']:.6g}",
                           device_peak_gib=f"{e['device_peak_gib']:.4g}",
                           host_peak_gib=f"{e['host_peak_gib']:.4g}")
            rows.append(row)
with open(os.path.join(out, "capacity.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)

bw_rows = []
for gbps in (4, 8, 12, 15.75, 24, 32, 48, 63):
    times = {}
    for tool in ("estimate", "simulate"):
        report = os.path.join(out, f"{tool}_bw.json")
        subprocess.run([pw, tool, "--model", "gpt-10b", "--cluster", "v100-32gb-ws",
                        "--set", "host.link=pcie5",
                        "--set", f"host.pcie_bandwidth_bytes_per_s={gbps * 1e9}",
                        "-b", "1", "-m", "8", "--schedule", "1f1b", "--recompute", "full",
                        "--offload", "optimizer", "--out", report],
                       check=True, stdout=subprocess.DEVNULL)
        with open(report) as f:
            times[tool] = json.load(f)["iteration_time_s"]
    bw_rows.append({"bandwidth_gb_per_s": gbps, "estimate_s": f"{times['estimate']:.6g}",
                    "simulate_s": f"{times['simulate']:.6g}"})
with open(os.path.join(out, "bandwidth.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(bw_rows[0]))
    w.writeheader()
    w.writerows(bw_rows)
for name in ("estimate.json", "estimate_bw.json", "simulate_bw.json"):
    os.remove(os.path.join(out, name))
PY

# Memory over time: a 2BW pipeline whose stashes go to the host and come back (KARMA) beside
# the optimizer offload's static host bytes, on four GH200 nodes (NVLink-C2C).
"$PW" simulate --model gpt3-13b --cluster gh200:4 --set network.bandwidth_bytes_per_s=5e10 -d 4 \
  -b 2 -m 8 --schedule 2bw --offload optimizer,activations --steps 2 \
  --out "$OUT/report_2bw.json" --timeline "$OUT/timeline_2bw.json" >/dev/null
rm -f "$OUT"/gpt-h4096-l*.json
echo "wrote $(ls "$OUT" | wc -l) files to $OUT"
