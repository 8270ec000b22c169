#!/usr/bin/env bash
# The real-GPU suite: what the simulator stands in for, checked against NVIDIA's driver.
#
#   tests/gpu/real-gpu.sh BIN_DIR RESULTS_DIR
#
# PART=compute: only the compute part and the bench; PART=limited: only the CPU-limited
# scenarios and the bench; PART=memops: only the stream memory operations (5d) and the
# bench; PROCS=0: the bench without its start-up figure; BENCH=0: no
# bench; ROUNDS=N: the CPU-limited scenarios N times (default 1), LIMITED=0: none of
# them; SCEN: which of them (default "3 1ms ten torch torch-ten": three tenants of 10 us
# kernels, two of 1 ms, ten of 10 us, two PyTorch, ten PyTorch); DAEMON_ARGS: extra
# arguments of the daemon for every scenario (e.g.
# "--co-hold-fill-pct 0": co-holding off, ADR 0029; the CPU-limited scenarios' own
# co-holding-off lines are then left out, the daemon taking the option once).
#
# BIN_DIR holds release builds of libvgpu.so, vgpu-daemon, vgpuctl, cuda-probe and
# shim-bench (`cargo build --release`; they need no Rust toolchain where this runs). The
# node needs an NVIDIA GPU with its driver; python3 with torch, cupy and nvidia-ml-py are
# used where present. Every step runs with a deadline and on its own: a failing step is
# reported (`FAIL <step>`) and the others still run. Each step prints what it measured;
# CHECK lines say what was expected and whether it held. Exit status: the number of
# failed checks (0: all held).
set -u
BIN=$(realpath "${1:?BIN_DIR}")
RES=$(realpath -m "${2:?RESULTS_DIR}")
mkdir -p "$RES"
WORK=$(mktemp -d /tmp/vgpu-real.XXXXXX)
FAILS=0
GIB=$((1 << 30))
MIB=$((1 << 20))

say() { echo "$*" | tee -a "$RES/summary.txt"; }
check() { # check NAME CONDITION-TEXT TRUE|FALSE
    if [ "$3" = true ]; then say "CHECK ok   $1: $2"; else say "CHECK FAIL $1: $2"; FAILS=$((FAILS + 1)); fi
}
val() { # val KEY TEXT: the last KEY=value in TEXT
    echo "$2" | tr ' ' '\n' | grep "^$1=" | tail -1 | cut -d= -f2-
}
probe() { timeout 120 "$BIN/cuda-probe" "$@" 2>&1; }
contained() { # contained DIR CMD...: CMD under the shim in container DIR; the daemon
    # socket is $SOCK (default: none); other VGPU_* settings come from the caller's
    # environment (`VGPU_MEMORY_LIMIT=1Gi contained …`)
    mkdir -p "$1"
    LD_PRELOAD=$BIN/libvgpu.so VGPU_CONTAINER_DIR=$1 VGPU_DAEMON_SOCKET=${SOCK:-off} "${@:2}"
}
shimmed() { # shimmed CONTAINER LIMIT ARGS...: cuda-probe under the shim, no daemon
    VGPU_MEMORY_LIMIT=$2 contained "$WORK/c-$1" probe "${@:3}"
}

say "== node"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader 2>&1 | tee -a "$RES/summary.txt"
say "kernel $(uname -r), $(nproc) CPUs"
timeout 60 python3 -c '
import cupy
p = cupy.cuda.runtime.getDeviceProperties(0)
print("array limits: " + " ".join(f"{k}={p[k]}" for k in ("maxTexture1D", "maxTexture2D", "maxTexture3D", "maxTexture1DMipmap", "maxTexture2DMipmap")))
' 2>&1 | tail -1 | tee -a "$RES/summary.txt"
ldconfig -p | grep -E "libcuda.so.1|libnvidia-ml.so.1" | tee -a "$RES/summary.txt"

if [ "${PART:-all}" = all ]; then
say "== 1. the spin kernel on the real driver (bare: no shim)"
out=$(probe init meminfo totalmem spin kernel 200 1000000)
echo "$out"
wall=$(val wall_us "$out")
say "200 spin kernels of 1 ms: wall ${wall:-?} us"
check spin "200 x 1 ms spin kernels take 200-260 ms of wall time" \
    "$([ -n "$wall" ] && [ "$wall" -ge 200000 ] && [ "$wall" -le 260000 ] && echo true || echo false)"
bare_total=$(val total "$out")
say "bare cuMemGetInfo total=$bare_total"

say "== 2. memory quota of 1 GiB under the shim, every allocation API"
out=$(shimmed mem 1Gi init meminfo totalmem nvml)
echo "$out"
check meminfo "cuMemGetInfo total is the quota (1 GiB) under the shim" \
    "$([ "$(val total "$out")" = "$GIB" ] && echo true || echo false)"
check totalmem "cuDeviceTotalMem is the quota" \
    "$([ "$(val totalmem "$out")" = "$GIB" ] && echo true || echo false)"
check nvml "nvmlDeviceGetMemoryInfo total is the quota" \
    "$([ "$(val nvml_total "$out")" = "$GIB" ] && echo true || echo false)"
out=$(shimmed edge 1Gi init alloc $GIB alloc 1 meminfo)
echo "$out"
check edge "the whole quota allocates, the first byte over it fails with 2 (OUT_OF_MEMORY)" \
    "$(echo "$out" | grep -q 'alloc=ok' && [ "$(echo "$out" | grep -c 'alloc=err code=2')" = 1 ] && echo true || echo false)"
for api in mem pitch managed async pool vmm array array3d mipmap; do
    out=$(shimmed "api-$api" 1Gi init until-oom "$api" $((64 * MIB)))
    got=$(val allocated "$out")
    code=$(val code "$out")
    say "until-oom $api 64 MiB: allocated=${got:-?} code=${code:-?} ($(echo "$out" | grep -v '=' | head -2 | tr '\n' ' '))"
    check "api-$api" "allocated ≤ 1 GiB and ≥ 1 GiB - 64 MiB, then OUT_OF_MEMORY" \
        "$([ -n "$got" ] && [ "$got" -le $GIB ] && [ "$got" -ge $((GIB - 64 * MIB)) ] && [ "$code" = 2 ] && echo true || echo false)"
done

say "== 3. eight processes of one container racing for a 1 GiB quota"
at=$(($(date +%s%3N) + 1500))
for i in $(seq 8); do
    VGPU_MEMORY_LIMIT=1Gi contained "$WORK/c-race" \
        timeout 60 "$BIN/cuda-probe" init at $at alloc-until-oom $((32 * MIB)) sleep 3000 >"$WORK/race-$i" 2>&1 &
done
wait
sum=0
for i in $(seq 8); do
    a=$(val allocated "$(cat "$WORK/race-$i")")
    sum=$((sum + ${a:-0}))
done
say "8 racing processes held $sum bytes together (quota $GIB)"
check race "8 racing processes together ≤ 1 GiB and ≥ 1 GiB - 8 x 32 MiB" \
    "$([ $sum -le $GIB ] && [ $sum -ge $((GIB - 256 * MIB)) ] && echo true || echo false)"

say "== 4. unmodified clients under the shim (PyTorch, CuPy, nvidia-ml-py, nvidia-smi)"
cat >"$WORK/torch_client.py" <<'EOF'
import sys
import torch
free, total = torch.cuda.mem_get_info()
print(f"torch_total={total} torch_free={free}")
held = []
try:
    while True:
        held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError:
    pass
print(f"torch_held={len(held) * (64 << 20)}")
del held
torch.cuda.empty_cache()
a = torch.randn(1024, 1024, device="cuda", dtype=torch.float64)
err = (a @ a - (a.cpu() @ a.cpu()).cuda()).abs().max().item()
print(f"torch_matmul_err={err:.3g}")
EOF
out=$(VGPU_MEMORY_LIMIT=2Gi contained "$WORK/c-torch" \
    timeout 180 python3 "$WORK/torch_client.py" 2>&1 | tail -5)
say "torch under a 2 GiB quota: $(echo "$out" | tr '\n' ' ')"
tt=$(val torch_total "$out")
th=$(val torch_held "$out")
check torch-total "torch.cuda.mem_get_info total is the 2 GiB quota" \
    "$([ "$tt" = $((2 * GIB)) ] && echo true || echo false)"
check torch-oom "PyTorch's allocations stop with OutOfMemoryError within the 2 GiB quota (≥ 1 GiB held)" \
    "$([ -n "$th" ] && [ "$th" -le $((2 * GIB)) ] && [ "$th" -ge $GIB ] && echo true || echo false)"
check torch-matmul "a float64 matmul under the shim equals the CPU's (error < 1e-9)" \
    "$(python3 -c "import sys; sys.exit(0 if float('${out##*torch_matmul_err=}'.split()[0]) < 1e-9 else 1)" 2>/dev/null && echo true || echo false)"
out=$(VGPU_MEMORY_LIMIT=3Gi contained "$WORK/c-py" \
    timeout 120 python3 -c '
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(f"pynvml_total={pynvml.nvmlDeviceGetMemoryInfo(h).total}")
try:
    import cupy
    print(f"cupy_total={cupy.cuda.runtime.memGetInfo()[1]}")
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    print(f"cupy_sum={float(x.sum())}")
except ImportError as e:
    print(f"cupy=absent")
' 2>&1 | tail -4)
say "nvidia-ml-py, cupy: $(echo "$out" | tr '\n' ' ')"
check pynvml "nvidia-ml-py's memory total is the 3 GiB quota" \
    "$([ "$(val pynvml_total "$out")" = $((3 * GIB)) ] && echo true || echo false)"
check cupy "CuPy's memGetInfo total is the 3 GiB quota" \
    "$([ "$(val cupy_total "$out")" = $((3 * GIB)) ] && echo true || echo false)"
out=$(VGPU_MEMORY_LIMIT=3Gi contained "$WORK/c-py" \
    timeout 60 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>&1)
say "nvidia-smi under the shim: memory.total=$out MiB"
check nvidia-smi "nvidia-smi under the shim shows the 3 GiB quota (3072 MiB)" \
    "$([ "$(echo "$out" | tr -d ' ')" = 3072 ] && echo true || echo false)"

fi
if [ "${PART:-all}" != memops ]; then
say "== 5. compute shares on the real GPU (daemon + shim; each tenant counts its spin kernels' device time)"
daemon() { # daemon [ARGS...]: (re)starts the daemon with these extra arguments
    if [ -n "${dpid:-}" ]; then
        kill "$dpid" 2>/dev/null
        wait "$dpid" 2>/dev/null
        rm -f "$WORK/d.sock" "$WORK/api.sock"
    fi
    "$BIN/vgpu-daemon" --ebpf off --ebpf-pin-dir off --socket "$WORK/d.sock" --api-socket "$WORK/api.sock" \
        --metrics-addr off "$@" >>"$WORK/daemon.log" 2>&1 &
    dpid=$!
    for _ in $(seq 100); do [ -S "$WORK/d.sock" ] && [ -S "$WORK/api.sock" ] && break; sleep 0.1; done
}
# shellcheck disable=SC2086 # DAEMON_ARGS is a list of arguments
daemon ${DAEMON_ARGS:-}
say "daemon arguments: ${DAEMON_ARGS:-(defaults)}"
# PyTorch tenants: bf16 matmuls, fixed work per iteration, so unlike the spin kernels'
# device time their counts are not inflated where kernels of several processes overlap.
cat >"$WORK/torch_load.py" <<'PY'
import os, sys, time
import torch
at, secs = float(sys.argv[1]) / 1000, float(sys.argv[2])
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = a @ a
torch.cuda.synchronize()
if len(sys.argv) > 3:
    # Warmed up at full speed; from here on in the CPU-limited cgroup (every thread).
    with open(os.path.join(sys.argv[3], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
time.sleep(max(0.0, at - time.time()))
n, end = 0, at + secs
while time.time() < end:
    for _ in range(20):
        b = a @ a
    torch.cuda.synchronize()
    n += 20
print(f"iters={n}")
PY
declare -A ITERS
torch_group() { # torch_group LABEL SHARE... ("bare": no shim): a PyTorch tenant per share,
    # named a, b, c, …, all starting together; each in a CPU-limited container of its own
    # where CPULIM is set. ITERS[NAME]: each one's iterations; TOTAL: theirs together.
    local label=$1
    shift
    local at=$(($(date +%s%3N) + 6000 + 1000 * $#)) pids=() names=() shares=("$@") n s cg i=0
    for s in "${shares[@]}"; do
        n=$(printf "\\$(printf %03o $((97 + i)))")
        i=$((i + 1))
        names+=("$n")
        cg=()
        [ -n "$CPULIM" ] && cg=("$(container "t$n")")
        if [ "$s" = bare ]; then
            timeout 60 python3 "$WORK/torch_load.py" $at 6 "${cg[@]}" >"$WORK/tt-$n" 2>&1 &
        else
            VGPU_COMPUTE_SHARE=$s SOCK=$WORK/d.sock contained "$WORK/ct-$n-$label" \
                timeout 60 python3 "$WORK/torch_load.py" $at 6 "${cg[@]}" >"$WORK/tt-$n" 2>&1 &
        fi
        pids+=($!)
    done
    looks_begin $(((at - $(date +%s%3N)) / 1000))
    wait "${pids[@]}"
    looks_end
    TOTAL=0
    ITERS=()
    GLINE="torch $label:"
    for i in "${!names[@]}"; do
        n=${names[$i]}
        uncontain "t$n"
        ITERS[$n]=$(val iters "$(tail -1 "$WORK/tt-$n")")
        ITERS[$n]=${ITERS[$n]:-0} # a tenant that did not finish did nothing
        TOTAL=$((TOTAL + ${ITERS[$n]}))
        GLINE="$GLINE $n(share ${shares[$i]}) ${ITERS[$n]}"
    done
    GLINE="$GLINE iterations; $TOTAL together"
}
# torch_say: the last torch_group's line and looks.
torch_say() {
    say "$GLINE"
    say_looks
}
torch_pair() { # torch_pair LABEL SHARE_A SHARE_B: torch_group of two; IA, IB, and TA (a's %)
    torch_group "$@"
    IA=${ITERS[a]} IB=${ITERS[b]}
    TA=$(python3 -c "print(round(100*${IA:-0}/max(${IA:-0}+${IB:-0},1), 1))")
    say "torch $1: a(share $2) ${IA:-?} iterations, b(share $3) ${IB:-?}: a did $TA % of the work $(grep -v iters= "$WORK/tt-a" | tail -1)"
    say_looks
}
torch_ok=false
timeout 60 python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && torch_ok=true
# CPU limit of each tenant's container in the scenarios that set it: "QUOTA_US:HOGS" (a
# cgroup v2 cpu.max of QUOTA_US per 100 ms, with HOGS busy loops of its own inside), or "".
CPULIM=""
CG=/sys/fs/cgroup
cg_ok=false
CGV=2
if grep -qw cpu $CG/cgroup.controllers 2>/dev/null; then
    echo +cpu >$CG/cgroup.subtree_control 2>/dev/null
    grep -qw cpu $CG/cgroup.subtree_control 2>/dev/null && cg_ok=true
elif [ -w $CG/cpu/cgroup.procs ]; then
    CG=$CG/cpu CGV=1 cg_ok=true
fi
say "cpu cgroup controller (v$CGV): $cg_ok"
container() { # container NAME: a CPU-limited cgroup with its busy loops; prints its path
    local cg=$CG/vgpu-real-$1
    mkdir -p "$cg"
    if [ $CGV = 2 ]; then
        echo "${CPULIM%%:*} 100000" >"$cg/cpu.max"
    else
        echo 100000 >"$cg/cpu.cfs_period_us"
        echo "${CPULIM%%:*}" >"$cg/cpu.cfs_quota_us"
    fi
    for _ in $(seq "${CPULIM##*:}"); do
        sh -c 'echo $$ >"$0/cgroup.procs" && exec sh -c "while :; do :; done"' "$cg" >/dev/null 2>&1 &
    done
    echo "$cg"
}
uncontain() { # uncontain NAME: ends its processes and removes it
    local cg=$CG/vgpu-real-$1
    [ -d "$cg" ] || return 0
    if [ -e "$cg/cgroup.kill" ]; then
        echo 1 >"$cg/cgroup.kill" 2>/dev/null
    else
        xargs -r kill -9 <"$cg/cgroup.procs" 2>/dev/null
    fi
    for _ in $(seq 50); do rmdir "$cg" 2>/dev/null && return 0; sleep 0.1; done
}
# What the daemon decided on, four looks 1.2-4.8 s into a window starting LEAD_S from
# now (looks_begin LEAD_S, then looks_end once the tenants are done): each tenant's
# state (co-held or not), fill and stopped part as `vgpuctl --json tenants` shows them;
# say_looks prints them.
looks_begin() {
    rm -f "$WORK"/snap-*.json
    (
        sleep "$1"
        for k in 1 2 3 4; do
            sleep 1.2
            timeout 5 "$BIN/vgpuctl" --api-socket "$WORK/api.sock" --json tenants >"$WORK/snap-$k.json" 2>/dev/null
        done
    ) &
    SNAPPER=$!
}
looks_end() { wait "$SNAPPER"; }
say_looks() {
    local looks
    looks=$(python3 - "$WORK"/snap-*.json <<'PY'
import json, os, sys
def pct(x):
    return "?" if x is None else f"{x:.0f}"
rows, waits = {}, {}
for f in sys.argv[1:]:
    try:
        v = json.load(open(f))
    except (OSError, ValueError):
        continue
    for t in v.get("tenants", []):
        g = (t.get("gpus") or [{}])[0]
        waits.setdefault(os.path.basename(t.get("key", "?")), []).append(
            (g.get("throttled_ns") or 0, g.get("gpu_time_ns") or 0))
        co = "+co" if g.get("co_held") else ""
        rows.setdefault(os.path.basename(t.get("key", "?")), []).append(
            f"{g.get('state', '?')}{co} fill {pct(g.get('fill_pct'))} stopped {pct(g.get('cpu_stopped_pct'))}"
            f" unclaimed {g.get('unclaimed_grants', '?')}/{g.get('grants', '?')}"
            f" expired {g.get('expired_grants', '?')}"
            f" slice {pct((g.get('slice_ns') or 0) / 1e6)} ms"
            f" queue {pct((g.get('queue_ahead_ns') or 0) / 1e6)} ms")
# Waited for the GPU, and charged GPU time, between the first and the last look (1.2 s
# apart each), as parts of that time.
def waited(k):
    w = waits.get(k, [])
    if len(w) < 2:
        return ""
    span = 1.2e9 * (len(w) - 1)
    return (f", waited {100 * (w[-1][0] - w[0][0]) / span:.0f} %"
            f", charged {100 * (w[-1][1] - w[0][1]) / span:.0f} %")
print("; ".join(f"{k}: " + ", ".join(r) + waited(k) for k, r in sorted(rows.items())))
PY
)
    [ -n "$looks" ] && say "   looks: $looks"
}
# tenants KERNEL_NS BATCH HOGS LABEL NAME:SHARE...: all start together and run 6 s; a
# share "bare" runs without the shim. Prints each one's part of the device time.
tenants() {
    local kns=$1 batch=$2 hogs=$3 label=$4
    shift 4
    local hp=()
    for _ in $(seq "$hogs"); do (while :; do :; done) & hp+=($!); done
    local at=$(($(date +%s%3N) + 2000)) specs=("$@") pids=()
    for spec in "${specs[@]}"; do
        local n=${spec%%:*} s=${spec##*:} pre=()
        if [ -n "$CPULIM" ]; then
            pre=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$(container "$n")")
        fi
        if [ "$s" = bare ]; then
            timeout 60 "${pre[@]}" "$BIN/cuda-probe" init load 6 "$kns" $at "$batch" >"$WORK/t-$n" 2>&1 &
        else
            VGPU_COMPUTE_SHARE=$s SOCK=$WORK/d.sock contained "$WORK/c-$n" \
                timeout 60 "${pre[@]}" "$BIN/cuda-probe" init load 6 "$kns" $at "$batch" >"$WORK/t-$n" 2>&1 &
        fi
        pids+=($!)
    done
    looks_begin 2
    wait "${pids[@]}"
    looks_end
    [ ${#hp[@]} -gt 0 ] && kill "${hp[@]}" 2>/dev/null
    for spec in "${specs[@]}"; do uncontain "${spec%%:*}"; done
    local tot=0 line="$label:"
    for spec in "${specs[@]}"; do
        local d=$(val device_ns "$(cat "$WORK/t-${spec%%:*}")")
        tot=$((tot + ${d:-0}))
    done
    WORST=0
    for spec in "${specs[@]}"; do
        local n=${spec%%:*} s=${spec##*:} d
        d=$(val device_ns "$(cat "$WORK/t-$n")")
        DEV[$n]=${d:-0}
        local pct=$(python3 -c "print(f'{100*${d:-0}/max($tot,1):.1f}')")
        line="$line $n(share $s)=$pct%"
        if [ "$s" != bare ]; then
            WORST=$(python3 -c "print(round(max($WORST, abs($pct - $s)), 2))")
        fi
    done
    say "$line; device time of all tenants = $(python3 -c "print(f'{100*$tot/6e9:.1f}')") % of 6 s; worst |error| ${WORST} pp"
    say_looks
}
# scen NAME: whether the CPU-limited rounds run scenario NAME (SCEN, default all: 3 1ms
# ten torch torch-ten).
scen() { case " ${SCEN:-3 1ms ten torch torch-ten} " in *" $1 "*) return 0 ;; esac; return 1; }
within() { python3 -c "print('true' if $WORST <= $1 else 'false')"; }
# Each tenant's device time in the last `tenants` run (DEV) and in the last unshared one
# (UNSH, kept by `unshared_was`).
declare -A DEV UNSH
unshared_was() { for k in "${!DEV[@]}"; do UNSH[$k]=${DEV[$k]}; done; }
# demand_met NAME:SHARE...: whether each tenant of the last run got at least 90 % of
# what it can use: the least of what it used unshared (what its CPU lets it use) and
# its share of the 6 s. A share is a guarantee under contention, not a cap on what a
# tenant the others leave room for may use.
demand_met() {
    local ok=true spec n s want
    for spec in "$@"; do
        n=${spec%%:*} s=${spec##*:}
        want=$(python3 -c "print(int(0.9 * min(${UNSH[$n]:-0}, $s * 6e9 / 100)))")
        [ "${DEV[$n]:-0}" -ge "$want" ] || ok=false
    done
    echo $ok
}
hogs=$((2 * $(nproc)))
if [ "${PART:-all}" != limited ]; then
tenants 1000000 1 0 "unshared, 2 processes, 1 ms kernels" a:bare b:bare
tenants 1000000 1 $hogs "unshared, 2 processes, 1 ms kernels, $hogs CPU hogs" a:bare b:bare
tenants 1000000 1 0 "25/75, 1 ms kernels" a:25 b:75
check share-25-75 "25/75 within ±2 pp" "$(within 2)"
tenants 100000 32 0 "3 tenants 20/30/50, 100 us kernels" a:20 b:30 c:50
check share-3 "20/30/50 within ±2 pp" "$(within 2)"
tenants 1000000 1 $hogs "25/75, 1 ms kernels, $hogs CPU hogs" a:25 b:75
check share-busy "25/75 within ±2 pp with every CPU saturated" "$(within 2)"
fi
if $cg_ok && [ "${LIMITED:-1}" != 0 ]; then
  for round in $(seq "${ROUNDS:-1}"); do
    say "-- CPU-limited tenants, round $round"
    CPULIM="50000:2"
    if scen 3; then
    tenants 10000 32 0 "unshared, 3 processes, 10 us kernels, each in 0.5 CPU with 2 busy loops" a:bare b:bare c:bare
    unshared_was
    tenants 10000 32 0 "3 tenants 20/30/50, 10 us kernels, each in 0.5 CPU with 2 busy loops" a:20 b:30 c:50
    check limited-demand "each CPU-limited tenant (20/30/50, 10 us) gets ≥ 90 % of min(its unshared device time, its share)" \
        "$(demand_met a:20 b:30 c:50)"
    fi
    if scen 1ms; then
    tenants 1000000 1 0 "unshared, 2 processes, 1 ms kernels, each in 0.5 CPU with 2 busy loops" a:bare b:bare
    unshared_was
    tenants 1000000 1 0 "25/75, 1 ms kernels, each in 0.5 CPU with 2 busy loops" a:25 b:75
    check limited-demand-1ms "each CPU-limited tenant (25/75, 1 ms) gets ≥ 90 % of min(its unshared device time, its share)" \
        "$(demand_met a:25 b:75)"
    fi
    # Ten such tenants of 10 % each, wanting more of the GPU together than it has while
    # their containers run at once.
    ten=(a:10 b:10 c:10 d:10 e:10 f:10 g:10 h:10 i:10 j:10)
    if scen ten; then
    tenants 10000 32 0 "unshared, 10 processes, 10 us kernels, each in 0.5 CPU with 2 busy loops" "${ten[@]/%:10/:bare}"
    unshared_was
    tenants 10000 32 0 "10 tenants of 10 %, 10 us kernels, each in 0.5 CPU with 2 busy loops" "${ten[@]}"
    check limited-demand-ten "each of ten CPU-limited tenants (10 %, 10 us) gets ≥ 90 % of min(its unshared device time, its share)" \
        "$(demand_met "${ten[@]}")"
    fi
    if $torch_ok && scen torch; then
        torch_pair limited-bare bare bare
        ua=$IA ub=$IB
        torch_pair limited 30 70
        check torch-limited "each CPU-limited PyTorch tenant (30/70) does ≥ 90 % of the work it did unshared (below its share)" \
            "$(python3 -c "print('true' if ${IA:-0} >= 0.9 * ${ua:-0} and ${IB:-0} >= 0.9 * ${ub:-0} else 'false')")"
    fi
    # Ten PyTorch tenants: fixed work per iteration, so unlike the spin kernels' device
    # time their counts are not inflated where the kernels of several processes overlap.
    if $torch_ok && scen torch-ten; then
        torch_group limited-ten-bare bare bare bare bare bare bare bare bare bare bare
        torch_say
        declare -A UITERS=()
        for k in "${!ITERS[@]}"; do UITERS[$k]=${ITERS[$k]}; done
        utotal=$TOTAL
        torch_group limited-ten 10 10 10 10 10 10 10 10 10 10
        torch_say
        check torch-limited-ten "ten CPU-limited PyTorch tenants of 10 % do together ≥ 90 % of their unshared work, and the one doing least ≥ 90 % of the least unshared" \
            "$(python3 -c "
u = [${UITERS[*]/%/,}]
v = [${ITERS[*]/%/,}]
print('true' if len(v) == 10 and min(u) > 0 and sum(v) >= 0.9 * $utotal and min(v) >= 0.9 * min(u) else 'false')")"
    fi
    # The same tenants with every tenant holding the GPU alone (co-holding off, ADR 0029's
    # baseline): figures, no check.
    case " ${DAEMON_ARGS:-} " in
    *" --co-hold-fill-pct"*) ;;
    *)
        # shellcheck disable=SC2086
        daemon --co-hold-fill-pct 0 ${DAEMON_ARGS:-}
        scen 3 && tenants 10000 32 0 "co-holding off: 3 tenants 20/30/50, 10 us kernels, each in 0.5 CPU with 2 busy loops" a:20 b:30 c:50
        scen 1ms && tenants 1000000 1 0 "co-holding off: 25/75, 1 ms kernels, each in 0.5 CPU with 2 busy loops" a:25 b:75
        $torch_ok && scen torch && torch_pair limited-co-holding-off 30 70
        if $torch_ok && scen torch-ten; then
            torch_group limited-ten-co-holding-off 10 10 10 10 10 10 10 10 10 10
            torch_say
        fi
        # shellcheck disable=SC2086
        daemon ${DAEMON_ARGS:-}
        ;;
    esac
    CPULIM=""
  done
fi
out=$(timeout 10 "$BIN/vgpuctl" --api-socket "$WORK/api.sock" --json gpus 2>&1)
pids=$(echo "$out" | python3 -c 'import json,sys; print(" ".join(str(p) for g in json.load(sys.stdin)["gpus"] for p in g.get("bypass_pids", [])))' 2>&1)
bp=0
for p in $pids; do
    # Each listed process: still there (and under the shim or not), or gone.
    if [ -r "/proc/$p/cmdline" ]; then
        shimmed=no
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q '^LD_PRELOAD=.*libvgpu' && shimmed=yes
        say "bypass pid $p: alive, under the shim: $shimmed, $(tr '\0' ' ' <"/proc/$p/cmdline" | cut -c1-120)"
        [ $shimmed = yes ] && bp=$((bp + 1))
    else
        say "bypass pid $p: gone (exited before this listing; an NVML reading up to 1 s old had it)"
        bp=$((bp + 1))
    fi
done
say "bypass processes listed right after the tenants exited: $(echo $pids | wc -w) ($bp shimmed or gone)"
check no-false-bypass "no tenant process that just exited is listed as a bypass" \
    "$([ "$bp" = 0 ] && echo true || echo false)"

if [ "${PART:-all}" != limited ]; then
say "== 5b. two PyTorch processes under the daemon: bf16 matmul iterations in 6 s"
torch_pair bare bare bare
torch_pair shares 30 70
check torch-shares "PyTorch tenants at 30/70 split the work 30 ± 3 %" \
    "$(python3 -c "print('true' if abs($TA - 30) <= 3 else 'false')")"
say "== 5c. a PyTorch CUDA graph captured under the daemon beside a contending tenant (ADR 0033)"
cat >"$WORK/torch_graph.py" <<'PY'
import time
import torch
a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):  # the warm-up torch.cuda.graph asks for
        b = a @ a
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):  # global capture mode, PyTorch's default
    b = a @ a
    time.sleep(0.05)  # the gate thread drains its slice meanwhile
    for _ in range(8):
        b = b @ a
n, t0 = 0, time.time()
while time.time() - t0 < 3:
    g.replay()
    n += 1
torch.cuda.synchronize()
print(f"graph=ok replays={n}")
PY
if $torch_ok; then
    VGPU_COMPUTE_SHARE=50 SOCK=$WORK/d.sock contained "$WORK/cg-other" \
        timeout 60 python3 "$WORK/torch_load.py" "$(date +%s%3N)" 6 >"$WORK/tg-other" 2>&1 &
    op=$!
    sleep 1
    out=$(VGPU_COMPUTE_SHARE=50 SOCK=$WORK/d.sock contained "$WORK/cg-graph" \
        timeout 60 python3 "$WORK/torch_graph.py" 2>&1 | tail -3)
    wait $op
    say "torch CUDA graph beside a contending tenant: $(echo "$out" | tr '\n' ' '); the other: $(tail -1 "$WORK/tg-other")"
    check torch-graph "a PyTorch CUDA graph captured (global mode, a pause in the capture) and replayed under the shim beside a contending tenant" \
        "$(echo "$out" | grep -q 'graph=ok' && echo true || echo false)"
fi
say "== 5e. a capped tenant turning to long kernels, with and without device-side gating (ADR 0034)"
for gate in off 8; do
    VGPU_COMPUTE_SHARE=80 SOCK=$WORK/d.sock contained "$WORK/dg-n-$gate" \
        probe init load 14 1000000 0 1 >"$WORK/dg-n-$gate.out" 2>&1 &
    np=$!
    sleep 1
    out=$(VGPU_COMPUTE_SHARE=20 VGPU_COMPUTE_POLICY=cap VGPU_LOG=1 VGPU_DEVICE_GATE=$gate \
        SOCK=$WORK/d.sock contained "$WORK/dg-$gate" \
        timeout 120 "$BIN/cuda-probe" init spin kernel 2000 10000 spin kernel 400 5000000 \
        2>"$WORK/dg-$gate.err" | tail -1)
    wait $np
    longest=$(grep -o 'held [0-9]* ' "$WORK/dg-$gate.err" | awk '{print $2}' | sort -n | tail -1)
    say "VGPU_DEVICE_GATE=$gate: $out; longest slice ${longest:-?} us over $(grep -c 'held ' "$WORK/dg-$gate.err") slices; the neighbour: $(tail -1 "$WORK/dg-n-$gate.out")"
    [ "$gate" = 8 ] && check device-gate "with device-side gating no slice of a capped tenant of 5 ms kernels lasts 300 ms" \
        "$([ -n "$longest" ] && [ "$longest" -lt 300000 ] && echo true || echo false)"
done
fi
timeout 10 "$BIN/vgpuctl" --api-socket "$WORK/api.sock" gpus 2>&1 | head -8 | tee -a "$RES/summary.txt"
kill $dpid 2>/dev/null
wait $dpid 2>/dev/null
cp "$WORK/daemon.log" "$RES/" 2>/dev/null

fi # PART != memops
if [ "${PART:-all}" = all ] || [ "${PART:-all}" = memops ]; then
say "== 5d. stream memory operations on the real driver, bare (device-side gating's footing, ADR 0034)"
out=$(probe init memop-gate 2000 10000 | tail -1)
say "memop-gate 2000 x 10 us: $out"
check memop-holds "a stream waiting on a word of mapped host memory runs nothing behind the wait until the host writes it (20 of 20)" \
    "$([ "$(val held "$out")" = 20/20 ] && echo true || echo false)"
say "a process whose stream waits on a word nobody writes, and a neighbour's 200 x 1 ms kernels beside it:"
alone=$(probe init spin kernel 200 1000000 | tail -1)
probe init memop-block 6000 >"$WORK/memop-block" &
bp=$!
sleep 1
beside=$(probe init spin kernel 200 1000000 | tail -1)
wait $bp
say "alone: $alone; beside the waiting process: $beside; it: $(tr '\n' ' ' <"$WORK/memop-block")"
check memop-neighbour "a waiting stream leaves the GPU to another process (its 200 ms of kernels within 1.2x of alone)" \
    "$(python3 -c "print('true' if ${beside##*wall_us=} <= 1.2 * ${alone##*wall_us=} else 'false')" 2>/dev/null || echo false)"
fi

say "== 6. shim overhead on the real driver (shim-bench: interleaved A/B in one process)"
variants="default off"
[ "${BENCH:-1}" = 0 ] && variants="" && say "(skipped: BENCH=0)"
for variant in $variants; do
    if [ $variant = off ]; then export VGPU_DAEMON_SOCKET=off; fi
    timeout 240 "$BIN/shim-bench" --iters 20000 --procs "${PROCS:-64}" >"$RES/shim-bench-$variant.txt" 2>&1
    echo "rc=$?" >>"$RES/shim-bench-$variant.txt"
    say "-- daemon socket: $variant"
    grep -v '^{' "$RES/shim-bench-$variant.txt" | tee -a "$RES/summary.txt"
    unset VGPU_DAEMON_SOCKET
done

say "== done: $FAILS failed checks"
rm -rf "$WORK"
exit "$FAILS"
