#!/usr/bin/env bash
# An emulated multi-node cluster on one Linux machine: N "nodes" as network namespaces, each with
# one veth link to a bridge (in a namespace of its own, so nothing is added to the host's network),
# every node's link shaped with tc (rate: tbf on its egress; delay: netem, where the kernel has it),
# addresses 10.77.0.0/24
# inside those namespaces only. Writes the matching pipewright cluster JSON, runs COMMAND with
# $PW_MPIRUN set to an mpirun command line that starts one process per node through the namespaces,
# and removes every namespace it made when COMMAND ends, fails or is interrupted.
#
# Usage (as root; iproute2 and Open MPI from Debian):
#   scripts/netns-cluster.sh [--nodes N] [--rate 100mbit] [--burst 8kb] [--delay 1ms] \
#       [--cluster-out FILE] \
#       -- COMMAND...
#   e.g. scripts/netns-cluster.sh --nodes 2 --rate 200mbit -- \
#        bash -c '$PW_MPIRUN -np 2 build/pipewright train --model gpt-tiny -d 2 -m 4 --steps 5'
#
# How the processes get into the namespaces: mpirun runs in a "head" namespace on the bridge
# (10.77.0.254) with a hostfile of the nodes (10.77.0.1 ...); its rsh agent is a small script that
# runs Open MPI's daemon in the node's namespace (ip netns exec, with a UTS namespace of its own so
# each node has its own host name). Messages go over the TCP BTL only (--mca btl tcp,self: shared
# memory would bypass the shaped links), on 10.77.0.0/24.
#
# Exit status: COMMAND's; 77 (with the reason) where namespaces cannot be made here (not root, no
# CAP_NET_ADMIN, no veth or tbf in the kernel, --delay without netem, no mpirun).
set -uo pipefail

NODES=2
RATE=100mbit
DELAY=""  # none: the veths' own (tens of us)
BURST=8kb  # tbf's bucket
CLUSTER_OUT=""
while (($#)); do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --burst) BURST=$2; shift 2 ;;
    --cluster-out) CLUSTER_OUT=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "netns-cluster: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if (($# == 0)); then echo "netns-cluster: no COMMAND after -- (see --help)" >&2; exit 2; fi
if ! [[ "$NODES" =~ ^[0-9]+$ ]] || ((NODES < 1 || NODES > 200)); then
  echo "netns-cluster: --nodes $NODES: 1 to 200" >&2; exit 2
fi

skip() { echo "SKIP: netns-cluster: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "needs root (ip netns add)"
command -v ip >/dev/null || skip "ip (iproute2) not found"
command -v tc >/dev/null || skip "tc (iproute2) not found"
command -v mpirun >/dev/null || skip "mpirun not found (openmpi-bin)"
command -v unshare >/dev/null || skip "unshare (util-linux) not found"

TAG="pw$$"   # every name made here carries it: concurrent runs do not collide
BR_NS="${TAG}br"
HEAD_NS="${TAG}hd"
WORK=$(mktemp -d)
made=()      # namespaces made so far, removed by cleanup

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # Processes left in the namespaces (a failed run) first, then the namespaces (their veths go
  # with them).
  for ns in "${made[@]}"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  for ns in "${made[@]}"; do
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkns() {
  ip netns add "$1" 2>"$WORK/err" || skip "ip netns add failed: $(head -1 "$WORK/err")"
  made+=("$1")
  ip -n "$1" link set lo up
}

mkns "$BR_NS"
ip -n "$BR_NS" link add br0 type bridge || skip "no bridge support in this kernel"
ip -n "$BR_NS" link set br0 up

# attach NS IFNAME ADDRESS: a veth from NS (named IFNAME there) to the bridge.
attach() {
  local ns=$1 ifname=$2 addr=$3 port=$4
  ip link add "${TAG}a" netns "$ns" type veth peer name "$port" netns "$BR_NS" 2>"$WORK/err" ||
    skip "veth: $(head -1 "$WORK/err")"
  ip -n "$ns" link set "${TAG}a" name "$ifname"
  ip -n "$ns" addr add "$addr/24" dev "$ifname"
  ip -n "$ns" link set "$ifname" up
  ip -n "$BR_NS" link set "$port" master br0
  ip -n "$BR_NS" link set "$port" up
}

mkns "$HEAD_NS"
attach "$HEAD_NS" pwnet 10.77.0.254 head

: >"$WORK/hostfile"
for ((i = 0; i < NODES; i++)); do
  ns="${TAG}n$i"
  mkns "$ns"
  attach "$ns" pwnet "10.77.0.$((i + 1))" "n$i"
  # The node's link: its egress at RATE (tbf with a small bucket, BURST, so that a message of
  # tens of KiB is not sent at the veth's speed out of a full bucket; a queue of up to 2 s, so TCP
  # sees no drops; tbf segments larger GSO packets), after
  # DELAY where asked (netem, where the kernel has it).
  if [ -n "$DELAY" ]; then
    tc -n "$ns" qdisc add dev pwnet root handle 1: netem delay "$DELAY" limit 100000 \
      2>"$WORK/err" || skip "--delay needs tc netem (sch_netem), which this kernel lacks: $(head -1 "$WORK/err")"
    parent="parent 1:1"
  else
    parent="root"
  fi
  tc -n "$ns" qdisc add dev pwnet $parent handle 10: tbf rate "$RATE" burst "$BURST" latency 2s \
    2>"$WORK/err" || skip "tc tbf: $(head -1 "$WORK/err")"
  echo "10.77.0.$((i + 1)) slots=1" >>"$WORK/hostfile"
  echo "10.77.0.$((i + 1)) $ns n$i" >>"$WORK/nodes"
done
# The rsh agent: "agent HOST COMMAND..." runs COMMAND in HOST's namespace, as ssh would run it
# (through a shell), under a host name of its own.
cat >"$WORK/agent" <<EOF
#!/bin/sh
host=\$1; shift
while [ "\${host#-}" != "\$host" ]; do host=\$1; shift; done  # ssh-style options, if any
line=\$(grep "^\$host " "$WORK/nodes") || { echo "netns-cluster agent: unknown host \$host" >&2; exit 1; }
set -- \$line "\$@"
ns=\$2; name=\$3; shift 3
exec ip netns exec "\$ns" unshare --uts sh -c "hostname \$name; \$*"
EOF
chmod +x "$WORK/agent"

# The cluster JSON: one device per node, the shaped link as the network (rate in bits/s -> bytes/s).
if [ -n "$CLUSTER_OUT" ]; then
  python3 - "$NODES" "$RATE" "$DELAY" "$CLUSTER_OUT" <<'EOF' || exit 1
import json, re, sys
nodes, rate, delay, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def num(text, units):
    m = re.fullmatch(r'([0-9.]+)([a-z]*)', text.lower())
    if not m or m.group(2) not in units: sys.exit(f"netns-cluster: cannot read {text!r}")
    return float(m.group(1)) * units[m.group(2)]
bits = num(rate, {'bit': 1, 'kbit': 1e3, 'mbit': 1e6, 'gbit': 1e9, '': 1})
seconds = num(delay, {'s': 1, 'ms': 1e-3, 'us': 1e-6, '': 1e-6}) if delay else 0.0
cluster = {
    "format": "pipewright.cluster/1",
    "name": f"netns-{nodes}x{rate}" + (f"-{delay}" if delay else ""),
    "nodes": nodes,
    "gpus_per_node": 1,
    "device": {"name": "cpu", "peak_fp32_flops_per_s": 1e10, "peak_fp16_flops_per_s": 1e10,
               "memory_bytes": 8 << 30, "memory_bandwidth_bytes_per_s": 1e10},
    "intra_node": {"kind": "none", "bandwidth_bytes_per_s": 0, "latency_s": 0, "efficiency": 1},
    "network": {"nic_per": "node", "bandwidth_bytes_per_s": bits / 8, "latency_s": seconds,
                "oversubscription": 1, "efficiency": 1},
    "host": {"memory_bytes": 8 << 30, "pcie_bandwidth_bytes_per_s": 0, "pcie_latency_s": 0},
    "notes": f"scripts/netns-cluster.sh: {nodes} network namespaces on one machine, each node's "
             f"veth shaped by tc (rate {rate}, delay {delay or 'none'}); the device is a placeholder "
             "(a measured CPU trace sets the compute times)",
}
json.dump(cluster, open(out, 'w'), indent=2)
open(out, 'a').write('\n')
EOF
  echo "netns-cluster: wrote $CLUSTER_OUT"
fi

# Eager TCP sends up to 4 MiB: Open MPI progresses the TCP BTL only inside MPI calls, so the rest
# of a rendezvous message (above the 64 KiB default) would wait for the sender's next MPI call
# while it computes; sent eagerly, the whole message is in the socket at once and drains meanwhile.
export PW_MPIRUN="ip netns exec $HEAD_NS env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
mpirun --hostfile $WORK/hostfile --mca plm_rsh_agent $WORK/agent --mca btl tcp,self \
--mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 --bind-to none \
--mca btl_tcp_eager_limit 4194304 --mca btl_tcp_rndv_eager_limit 4194304 \
--mca btl_tcp_max_send_size 4194304"
echo "netns-cluster: $NODES nodes (10.77.0.1-$NODES), links $RATE, delay ${DELAY:-none}; \$PW_MPIRUN set"
"$@"
