#!/usr/bin/env bash
# The one-node Kubernetes run of issue 40 (docs/cluster.md); started by `cargo xtask
# cluster`, which builds the images and checks that the binaries are there.
#
# Brings up etcd, kube-apiserver, kube-controller-manager, kube-scheduler (from
# $VGPU_K8S_BIN), containerd + runc + CNI (Debian) and kubelet on 127.0.0.1; loads the
# project's images; installs from deploy/ with cuda-sim as the node's driver; checks what
# issue 40 lists; tears everything down (kills by PID, unmounts, restores sysctls, removes
# the addresses it added). Every check prints `CHECK <name>: PASS|FAIL <detail>`; the
# summary goes to $W/summary.txt. Exit status: 0 when every check passed.
#
# What stands in for a GPU node here, and why (each a line in docs/cluster.md):
# - the `nvidia` RuntimeClass is containerd's runc with a base OCI spec that mounts
#   cuda-sim's libcuda.so.1 / libnvidia-ml.so.1 and the simulated node's state directory
#   (what NVIDIA's container toolkit does with the real driver's files);
# - /dev/nvidia0..3, /dev/nvidiactl are made on the host with the simulator's
#   numbers (195:N, 195:255), as the driver makes them, and removed afterwards;
# - no kube-proxy or DNS: the vgpu pods run with hostNetwork, the second scheduler finds
#   the extender's Service name through hostAliases (127.0.0.1), the apiserver's Service
#   address 10.96.0.1 is put on lo; the node's address is 192.0.2.2 on lo (kubelet refuses
#   a loopback one), so `kubectl exec` and `logs` reach the kubelet.
set -uo pipefail

: "${VGPU_K8S_BIN:?}" "${VGPU_SIM_LIBS:?}" "${VGPU_ROOT:?}" "${VGPU_K8S_VERSION:?}"
ROOT=$VGPU_ROOT
W=${VGPU_CLUSTER_DIR:-/tmp/vgpu-cluster}
K=$VGPU_K8S_BIN
NODE=vgpu-node
NODE_IP=192.0.2.2
SVC_IP=10.96.0.1
SIM=/var/lib/vgpu-sim
DEV_NODES="nvidiactl nvidia0 nvidia1 nvidia2 nvidia3 nvidia-uvm nvidia-uvm-tools"
ETCD_PORT=23790
export KUBECONFIG=$W/admin.kubeconfig
PIDS=()
FAILED=0
declare -A ADDED_ADDR=()
SYSCTLS="vm.overcommit_memory kernel.panic kernel.panic_on_oops"
declare -A SAVED_SYSCTL=()

log() { printf '[%6.1fs] %s\n' "$(awk "BEGIN{print $(date +%s.%N) - $T_START}")" "$*"; }
T_START=$(date +%s.%N)
kc() { "$K/kubectl" "$@"; }
# kubectl's client-side validation needs the API server's generated OpenAPI schemas, which
# a build from a tree without generated code lacks ("the server is currently unable to
# handle the request"): apply and create use --validate=false. Server warnings (e.g. a
# CRD's unrecognized format) still reach the output.
check() { # name ok(0/1) detail
  local r=PASS; [ "$2" = 0 ] || { r=FAIL; FAILED=1; }
  printf 'CHECK %s: %s %s\n' "$1" "$r" "$3" | tee -a "$W/summary.txt"
}
note() { printf '%s\n' "$*" | tee -a "$W/summary.txt"; }
start() { # name cmd... : runs in the background, logs to $W/log/name.log
  local name=$1; shift
  "$@" >"$W/log/$name.log" 2>&1 &
  PIDS+=("$!"); eval "PID_$name=$!"
  log "started $name (pid $!)"
}
stop_pid() { # pid: TERM, then KILL after 10 s
  local p=$1 i
  kill -TERM "$p" 2>/dev/null || return 0
  for i in $(seq 100); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null
}
wait_for() { # seconds description cmd...
  local t=$1 what=$2 end; shift 2
  end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$end" ]; then log "timed out after ${t}s waiting for $what"; return 1; fi
    sleep 0.5
  done
}

teardown() {
  set +e
  log "teardown"
  # Containers first (kubelet would restart them), then the processes, newest first.
  [ -n "${PID_kubelet:-}" ] && stop_pid "$PID_kubelet"
  if [ -S "$W/containerd.sock" ]; then
    for c in $(ctr -a "$W/containerd.sock" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr -a "$W/containerd.sock" -n k8s.io tasks kill -s KILL "$c" >/dev/null 2>&1
    done
    sleep 1
    for c in $(ctr -a "$W/containerd.sock" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr -a "$W/containerd.sock" -n k8s.io tasks delete -f "$c" >/dev/null 2>&1
    done
  fi
  local i
  for (( i=${#PIDS[@]}-1; i>=0; i-- )); do stop_pid "${PIDS[$i]}"; done
  # shims outlive containerd: kill the ones of our socket by PID.
  for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $W/containerd.sock" 2>/dev/null); do
    kill -KILL "$p" 2>/dev/null
  done
  # Container processes whose shim is gone: every PID left in a kubepods cgroup.
  for f in $(find /sys/fs/cgroup -path '*kubepods*' -name cgroup.procs 2>/dev/null); do
    for p in $(cat "$f" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  sleep 0.5
  # Mounts under our directories (kubelet's self bind mount, pod volumes, containerd's).
  for m in $(awk '{print $5}' /proc/self/mountinfo | grep -E "^(/var/lib/kubelet|$W|/run/containerd-vgpu-cluster)" | sort -r); do
    umount -l "$m" 2>/dev/null
  done
  [ -n "${MOUNTED_BPF:-}" ] && umount /sys/fs/bpf
  [ -n "${MOUNTED_TRACEFS:-}" ] && umount /sys/kernel/tracing
  for s in $SYSCTLS; do
    [ -n "${SAVED_SYSCTL[$s]:-}" ] && sysctl -qw "$s=${SAVED_SYSCTL[$s]}"
  done
  for a in "${!ADDED_ADDR[@]}"; do ip addr del "$a/32" dev lo 2>/dev/null; done
  for d in $DEV_NODES; do
    [ -n "${MADE_DEV:-}" ] && rm -f "/dev/$d"
  done
  # kubepods cgroups kubelet made (cgroup v1 and v2 layouts).
  for c in $(find /sys/fs/cgroup -depth -type d -name 'kubepods*' 2>/dev/null); do
    find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  rm -rf /var/lib/kubelet /var/log/pods /var/log/containers "$SIM" /var/lib/vgpu /sys/fs/bpf/vgpu /run/containerd-vgpu-cluster
  log "teardown done (state left for reading: $W/log, $W/summary.txt)"
}

# ---- preflight ----------------------------------------------------------------------
if [ -e /var/lib/kubelet ] || [ -e /var/lib/vgpu ] || [ -e /dev/nvidiactl ] || [ -e /dev/nvidia-uvm ]; then
  echo "cluster: /var/lib/kubelet, /var/lib/vgpu, /dev/nvidiactl or /dev/nvidia-uvm exists: another node runs here; not touching it" >&2
  exit 1
fi
for port in $ETCD_PORT 443 10250 10257 10259 10359 8888 9400 9401; do
  if (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; then
    echo "cluster: port $port on 127.0.0.1 is in use" >&2; exit 1
  fi
done
rm -rf "$W"; mkdir -p "$W/log" "$W/pki" "$W/cni" "$W/manifests"
: > "$W/summary.txt"
trap teardown EXIT
trap 'exit 130' INT TERM
for s in $SYSCTLS; do SAVED_SYSCTL[$s]=$(sysctl -n "$s"); done
for a in $NODE_IP $SVC_IP; do
  ip addr add "$a/32" dev lo && ADDED_ADDR[$a]=1
done
note "versions: $("$K/kube-apiserver" --version) (apiserver), $("$K/kubelet" --version) (kubelet), etcd $(etcd --version | awk '/etcd Version/{print $3}'), containerd $(containerd --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}'), CNI plugins $(dpkg-query -W -f='${Version}' containernetworking-plugins 2>/dev/null), kernel $(uname -r), cgroup $(stat -fc %T /sys/fs/cgroup)"

# ---- certificates -------------------------------------------------------------------
P=$W/pki
(
  cd "$P"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj "/CN=vgpu-cluster-ca" 2>/dev/null
  leaf() { # name subject san
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  }
  leaf apiserver "/CN=kube-apiserver" "IP:127.0.0.1,IP:$SVC_IP,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  leaf admin "/O=system:masters/CN=admin" "DNS:admin"
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
)
cat > "$KUBECONFIG" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:443", certificate-authority: $P/ca.crt}}]
users: [{name: admin, user: {client-certificate: $P/admin.crt, client-key: $P/admin.key}}]
contexts: [{name: c, context: {cluster: c, user: admin}}]
current-context: c
EOF

# ---- control plane ------------------------------------------------------------------
start etcd etcd --name vgpu --data-dir "$W/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
  --initial-cluster vgpu=http://127.0.0.1:23800
start apiserver "$K/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --bind-address 0.0.0.0 --secure-port 443 --advertise-address "$SVC_IP" \
  --tls-cert-file "$P/apiserver.crt" --tls-private-key-file "$P/apiserver.key" \
  --client-ca-file "$P/ca.crt" --service-account-key-file "$P/sa.pub" \
  --service-account-signing-key-file "$P/sa.key" --service-account-issuer https://kubernetes.default.svc \
  --service-cluster-ip-range 10.96.0.0/16 --authorization-mode Node,RBAC --allow-privileged \
  --kubelet-client-certificate "$P/admin.crt" --kubelet-client-key "$P/admin.key" \
  --kubelet-preferred-address-types InternalIP --endpoint-reconciler-type none
wait_for 60 "the API server" kc get --raw /readyz || exit 1
log "API server ready"
start controller_manager "$K/kube-controller-manager" --kubeconfig "$KUBECONFIG" \
  --leader-elect=false --bind-address 127.0.0.1 --secure-port 10257 \
  --service-account-private-key-file "$P/sa.key" --root-ca-file "$P/ca.crt" \
  --use-service-account-credentials --controllers '*,-nodeipam,-service-lb-controller,-cloud-node-lifecycle' \
  --cluster-signing-cert-file "$P/ca.crt" --cluster-signing-key-file "$P/ca.key"
start_scheduler() { # flags
  start scheduler "$K/kube-scheduler" --bind-address 127.0.0.1 --secure-port 10359 "$@"
}
start_scheduler --kubeconfig "$KUBECONFIG" --leader-elect=false

# ---- node: simulated driver, containerd, kubelet --------------------------------------
# bpffs and tracefs as a node has them (the daemon's eBPF gate mounts /sys/fs/bpf with
# Bidirectional propagation, which needs a shared mount).
if [ "$(stat -fc %T /sys/fs/bpf)" != bpf_fs ]; then mount -t bpf bpf /sys/fs/bpf && MOUNTED_BPF=1; fi
mount --make-shared /sys/fs/bpf
if [ "$(stat -fc %T /sys/kernel/tracing)" != tracefs ]; then mount -t tracefs tracefs /sys/kernel/tracing && MOUNTED_TRACEFS=1; fi
mkdir -p "$SIM"
cat > "$SIM/node.toml" <<EOF
[[device]]
memory = "80Gi"
[[device]]
memory = "80Gi"
[[device]]
memory = "80Gi"
[[device]]
memory = "80Gi"
EOF
# The simulator makes its device nodes in $SIM/dev (nvidia-uvm with the dynamic major it
# picks) at its first initialisation, here on the host as root; /dev gets the same numbers,
# as a node with the driver has them: the device plugin then hands each pod its GPUs' nodes
# and the control nodes, and kubelet's device cgroup allows exactly those.
VGPU_SIM_DIR="$SIM" VGPU_SIM_CONFIG="$SIM/node.toml" LD_LIBRARY_PATH="$VGPU_SIM_LIBS" \
  "$ROOT/target/release/cuda-probe" init > /dev/null
MADE_DEV=1
for d in $DEV_NODES; do
  mknod -m 666 "/dev/$d" c $((0x$(stat -c %t "$SIM/dev/$d"))) $((0x$(stat -c %T "$SIM/dev/$d"))) || exit 1
done
ctr oci spec > "$W/default-spec.json"
python3 - "$W/default-spec.json" "$W/nvidia-spec.json" "$VGPU_SIM_LIBS" "$SIM" <<'EOF'
import json, sys
spec = json.load(open(sys.argv[1])); libs, sim = sys.argv[3], sys.argv[4]
for name in ["libcuda.so.1", "libnvidia-ml.so.1"]:
    for dst in ["/usr/lib/x86_64-linux-gnu/" + name]:
        spec["mounts"].append({"destination": dst, "type": "bind", "source": f"{libs}/{name}", "options": ["rbind", "ro"]})
spec["mounts"].append({"destination": sim, "type": "bind", "source": sim, "options": ["rbind", "rw"]})
spec["process"].setdefault("env", []).extend([f"VGPU_SIM_DIR={sim}", f"VGPU_SIM_CONFIG={sim}/node.toml"])
json.dump(spec, open(sys.argv[2], "w"), indent=1)
EOF
cat > "$W/cni/10-loopback.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "lo", "plugins": [{"type": "loopback"}]}
EOF
cat > "$W/containerd.toml" <<EOF
version = 2
root = "$W/containerd/root"
state = "/run/containerd-vgpu-cluster"
[grpc]
  address = "$W/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/vgpu/cluster-test:0.1.0"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      base_runtime_spec = "$W/nvidia-spec.json"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$W/cni"
EOF
start containerd containerd --config "$W/containerd.toml"
wait_for 30 containerd ctr -a "$W/containerd.sock" version || exit 1
T0=$(date +%s.%N)
for f in "$ROOT"/target/images/*.oci.tar "$ROOT"/target/images/cluster/*.oci.tar; do
  ctr -a "$W/containerd.sock" -n k8s.io images import "$f" >/dev/null || { check images-load 1 "$f"; exit 1; }
done
T1=$(date +%s.%N)
check images-load 0 "$(ctr -a "$W/containerd.sock" -n k8s.io images ls -q | grep -c .) images into containerd in $(awk "BEGIN{printf \"%.1f\", $T1-$T0}") s: $(ctr -a "$W/containerd.sock" -n k8s.io images ls -q | tr '\n' ' ')"
cat > "$W/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$W/containerd.sock
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}, x509: {clientCAFile: $P/ca.crt}}
authorization: {mode: AlwaysAllow}
address: $NODE_IP
readOnlyPort: 0
failSwapOn: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "0%", nodefs.available: "0%", imagefs.available: "0%", nodefs.inodesFree: "0%"}
serializeImagePulls: false
EOF
start kubelet "$K/kubelet" --kubeconfig "$KUBECONFIG" --config "$W/kubelet.yaml" \
  --node-ip "$NODE_IP" --hostname-override "$NODE" --root-dir /var/lib/kubelet
wait_for 90 "node Ready" sh -c "'$K/kubectl' get node $NODE -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -q True" || exit 1
log "node $NODE Ready"
wait_for 60 "ServiceAccount default/default" kc -n default get serviceaccount default || exit 1

# ---- the chart: rendered with helm where VGPU_K8S_BIN has it ------------------------------
if [ -x "$K/helm" ]; then
  "$K/helm" template vgpu "$ROOT/charts/vgpu" --include-crds > "$W/chart.yaml" 2> "$W/log/helm.log"
  kc create --dry-run=client -o json -f "$W/chart.yaml" > "$W/chart.json" 2>>"$W/log/helm.log"
  kc create --dry-run=client -o json -f "$ROOT/deploy/" > "$W/deploy.json" 2>>"$W/log/helm.log"
  diff=$(python3 - "$W/chart.json" "$W/deploy.json" <<'EOF'
import json, sys
def objs(p):
    d = json.load(open(p)); items = d.get("items", [d]) if d.get("kind") == "List" else [d]
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in items}
a, b = objs(sys.argv[1]), objs(sys.argv[2])
out = [f"only in chart: {k}" for k in a.keys() - b.keys()] + [f"only in deploy/: {k}" for k in b.keys() - a.keys()]
out += [f"differs: {k}" for k in a.keys() & b.keys() if a[k] != b[k]]
print("; ".join(sorted(out)))
EOF
)
  [ -z "$diff" ]; check chart-renders-deploy $? "helm template charts/vgpu (defaults) vs deploy/: ${diff:-the same objects}"
else
  note "chart: NOT RENDERED: no helm in $K (the chart's static structure is checked in CI only)"
fi

# ---- install (scheduler mode a) -------------------------------------------------------
kc create --validate=false -f - >/dev/null <<EOF
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: nvidia}
handler: nvidia
EOF
kc label node "$NODE" vgpu.io/enabled=true >/dev/null
T_INSTALL=$(date +%s.%N)
kc apply --validate=false -f "$ROOT/deploy/" > "$W/log/apply.log" 2>&1
check apply-deploy $? "kubectl apply -f deploy/: $(grep -c . "$W/log/apply.log") objects; warnings: $(grep -ci warning "$W/log/apply.log")"
grep -i warning "$W/log/apply.log" | sed 's/^/  /' | tee -a "$W/summary.txt"
# The script's `kubectl apply` needs --validate=false here too (above): a wrapper adds it.
mkdir -p "$W/bin"
printf '#!/bin/sh\nif [ "$1" = apply ]; then shift; exec "%s/kubectl" apply --validate=false "$@"; fi\nexec "%s/kubectl" "$@"\n' "$K" "$K" > "$W/bin/kubectl"
chmod +x "$W/bin/kubectl"
(cd "$W" && OUT="$W/vgpu-tls" PATH="$W/bin:$PATH" sh "$ROOT/deploy/tls/make-certs.sh" --apply > "$W/log/certs.log" 2>&1)
check certificates $? "deploy/tls/make-certs.sh --apply"
# The lab's stand-ins (see the header): hostNetwork, the extender's name, the scheduler's
# image built from VGPU_K8S_BIN.
kc -n vgpu-system patch daemonset vgpu-node-agent --type merge -p '{"spec":{"template":{"spec":{"hostNetwork":true}}}}' >/dev/null
kc -n vgpu-system patch deployment vgpu-scheduler-extender --type merge -p '{"spec":{"template":{"spec":{"hostNetwork":true}}}}' >/dev/null
kc -n vgpu-system patch deployment vgpu-scheduler --type strategic -p "{\"spec\":{\"template\":{\"spec\":{\"hostNetwork\":true,\"hostAliases\":[{\"ip\":\"127.0.0.1\",\"hostnames\":[\"vgpu-scheduler-extender.vgpu-system.svc\"]}],\"containers\":[{\"name\":\"kube-scheduler\",\"image\":\"registry.k8s.io/kube-scheduler:$VGPU_K8S_VERSION\"}]}}}}" >/dev/null
ready_ds() { [ "$(kc -n vgpu-system get ds vgpu-node-agent -o jsonpath='{.status.numberReady}')" = 1 ]; }
ready_deploy() { [ "$(kc -n vgpu-system get deploy "$1" -o jsonpath='{.status.readyReplicas}')" = 1 ]; }
gpus_on_node() { kc get node "$NODE" -o jsonpath='{.status.allocatable.vgpu\.io/gpu}'; }
wait_for 120 "the node agent Ready" ready_ds; r=$?
check node-agent-ready $r "DaemonSet vgpu-node-agent Ready; node allocatable vgpu.io/gpu=$(gpus_on_node)"
wait_for 120 "the extender Ready" ready_deploy vgpu-scheduler-extender; r1=$?
wait_for 120 "vgpu-scheduler Ready" ready_deploy vgpu-scheduler; r2=$?
check extender-and-scheduler-ready $((r1 + r2)) "extender readyReplicas=$(kc -n vgpu-system get deploy vgpu-scheduler-extender -o jsonpath='{.status.readyReplicas}'), vgpu-scheduler readyReplicas=$(kc -n vgpu-system get deploy vgpu-scheduler -o jsonpath='{.status.readyReplicas}')"
wait_for 60 "vgpu.io/gpu on the node" sh -c "[ -n \"\$('$K/kubectl' get node $NODE -o jsonpath='{.status.allocatable.vgpu\\.io/gpu}')\" ]"
if [ $r -ne 0 ] || [ $r1 -ne 0 ] || [ $r2 -ne 0 ]; then
  kc get pods -A -o wide > "$W/log/pods.txt" 2>&1
  kc get events -A > "$W/log/events.txt" 2>&1
  log "install failed: see $W/log/pods.txt, events.txt"; exit 1
fi

# ---- tenants ----------------------------------------------------------------------
# The tenants run as root, as most images do, under kubelet's device isolation: the
# simulator opens the device nodes like NVIDIA's driver, and a GPU whose node the pod's
# device cgroup refuses is not there for it (cuda-sim/src/devnodes.rs).
tenant() { # name namespace scheduler gpu memoryMiB compute
  cat <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $2, labels: {vgpu-cluster-test: tenant}}
spec:
  schedulerName: $3
  runtimeClassName: nvidia
  hostNetwork: true
  terminationGracePeriodSeconds: 1
  containers:
  - name: cuda
    image: vgpu/cluster-test:0.1.0
    imagePullPolicy: Never
    command: [cuda-probe, init, meminfo, ready, sleep, "3600000"]
    resources:
      limits: {vgpu.io/gpu: "$4", vgpu.io/gpu-memory: "$5", vgpu.io/gpu-compute: "$6"}
---
EOF
}
running_count() { kc get pods -A -l vgpu-cluster-test=tenant --field-selector=status.phase=Running -o name | grep -c .; }
quota_of() { # pod namespace -> total= printed by cuda-probe's meminfo, MiB
  kc -n "$2" logs "$1" 2>/dev/null | sed -n 's/.*total=\([0-9]*\).*/\1/p' | head -1
}
check_quotas() { # namespace list of name:memMiB
  local ns=$1 bad=0 n=0 got want name; shift
  for item in "$@"; do
    name=${item%%:*}; want=${item#*:}
    got=$(quota_of "$name" "$ns")
    n=$((n + 1))
    if [ -z "$got" ] || [ "$got" != "$((want * 1048576))" ]; then
      bad=$((bad + 1)); echo "  $ns/$name: total=$got, expected $((want * 1048576)) ($want MiB)" | tee -a "$W/summary.txt"
    fi
  done
  echo "$bad/$n"
}
kc create namespace tenants >/dev/null
wait_for 30 "ServiceAccount tenants/default" kc -n tenants get serviceaccount default
# 20 mixed sizes (slices:MiB:compute %) over four 80 GiB GPUs of 10 slices each.
SIZES=(1:2048:10 1:4096:10 2:8192:20 1:1024:5 1:512:5 3:12288:30 1:3000:10 2:6000:20 1:700:10 1:1500:10)
ITEMS=()
: > "$W/tenants.yaml"
for i in $(seq 0 19); do
  IFS=: read -r g m c <<< "${SIZES[$((i % 10))]}"
  tenant "t$i" tenants vgpu-scheduler "$g" "$m" "$c" >> "$W/tenants.yaml"
  ITEMS+=("t$i:$m")
done
T_T0=$(date +%s.%N)
kc apply --validate=false -f "$W/tenants.yaml" > /dev/null
FIRST=""
end=$(( $(date +%s) + 180 ))
while [ "$(date +%s)" -lt "$end" ]; do
  n=$(running_count)
  [ -z "$FIRST" ] && [ "$n" -ge 1 ] && FIRST=$(date +%s.%N)
  [ "$n" -ge 20 ] && break
  sleep 0.5
done
T_ALL=$(date +%s.%N)
n=$(running_count)
note "time from kubectl apply -f deploy/ to the first tenant pod Running: $(awk "BEGIN{printf \"%.1f\", ${FIRST:-0}-$T_INSTALL}") s (tenants created $(awk "BEGIN{printf \"%.1f\", $T_T0-$T_INSTALL}") s after the install; first Running $(awk "BEGIN{printf \"%.1f\", ${FIRST:-0}-$T_T0}") s, all 20 $(awk "BEGIN{printf \"%.1f\", $T_ALL-$T_T0}") s after they were created)"
sleep 2
bad=$(check_quotas tenants "${ITEMS[@]}")
[ "$n" = 20 ] && [ "${bad%%/*}" = 0 ]; check twenty-fractional-pods $? "$n/20 Running via vgpu-scheduler; wrong quotas (cuMemGetInfo total vs vgpu.io/gpu-memory): $bad"
[ "$n" = 20 ] || { kc get pods -A -o wide > "$W/log/pods.txt"; kc get events -A > "$W/log/events.txt"; }
if [ "${bad%%/*}" != 0 ]; then
  { kc -n tenants logs t0; kc -n tenants logs t0 --previous; } > "$W/log/t0.log" 2>&1
  note "  tenants/t0's output: $(grep -v '^$' "$W/log/t0.log" | head -4 | tr '\n' ' ')"
fi

# ---- quota policy -------------------------------------------------------------------
kc create namespace limited >/dev/null
wait_for 30 "ServiceAccount limited/default" kc -n limited get serviceaccount default
kc apply --validate=false -f - >/dev/null <<EOF
apiVersion: vgpu.io/v1alpha1
kind: VgpuQuotaPolicy
metadata: {name: gpu, namespace: limited}
spec:
  limits: {memory: 1Gi}
EOF
sleep 2
{ tenant small limited vgpu-scheduler 1 512 5; tenant big limited vgpu-scheduler 1 2048 5; } | kc apply --validate=false -f - >/dev/null
wait_for 60 "limited/small Running" sh -c "'$K/kubectl' -n limited get pod small -o jsonpath='{.status.phase}' | grep -q Running"; r=$?
wait_for 60 "a FailedScheduling event for limited/big" sh -c "'$K/kubectl' -n limited get events --field-selector involvedObject.name=big,reason=FailedScheduling -o name | grep -q ."
ev=$(kc -n limited get events --field-selector involvedObject.name=big,reason=FailedScheduling -o jsonpath='{.items[0].message}')
phase=$(kc -n limited get pod big -o jsonpath='{.status.phase}')
[ $r = 0 ] && [ "$phase" = Pending ] && echo "$ev" | grep -q "quota policy"; check quota-policy-refusal $? "small (512 MiB) $(kc -n limited get pod small -o jsonpath='{.status.phase}'), big (2048 MiB > limits.memory 1Gi) $phase; event: $ev"

# ---- metrics and vgpuctl --------------------------------------------------------------
dm=$(curl -s http://127.0.0.1:9400/metrics); pm=$(curl -s http://127.0.0.1:9401/metrics); em=$(curl -sk https://127.0.0.1:8888/metrics)
[ -n "$dm" ] && [ -n "$pm" ] && [ -n "$em" ]; check metrics $? "daemon :9400 $(echo "$dm" | grep -c '^vgpu_') vgpu_ series, plugin :9401 $(echo "$pm" | grep -c '^vgpu_'), extender :8888 $(echo "$em" | grep -c '^vgpu_')"
top=$(kc -n vgpu-system exec ds/vgpu-node-agent -c vgpu-daemon -- vgpuctl top --once 2>&1); r=$?
echo "$top" > "$W/log/vgpuctl-top.txt"
tenants_in_top=$(echo "$top" | grep -c -E 'tenants/t[0-9]+:cuda')
[ $r = 0 ] && [ "$tenants_in_top" -ge 20 ]; check vgpuctl-top $? "kubectl exec ds/vgpu-node-agent -c vgpu-daemon -- vgpuctl top --once: rc $r, $tenants_in_top tenant lines (see $W/log/vgpuctl-top.txt)"

# ---- rolling restart of the node agent with tenants running ---------------------------
before=$(kc get pods -n tenants -o jsonpath='{range .items[*]}{.status.containerStatuses[0].restartCount}{"\n"}{end}' | sort | uniq -c | tr '\n' ' ')
old=$(kc -n vgpu-system get pods -l app.kubernetes.io/name=vgpu-node-agent -o jsonpath='{.items[0].metadata.name}')
T_R=$(date +%s.%N)
kc -n vgpu-system rollout restart ds/vgpu-node-agent >/dev/null
kc -n vgpu-system rollout status ds/vgpu-node-agent --timeout=120s >/dev/null; r=$?
T_R1=$(date +%s.%N)
new=$(kc -n vgpu-system get pods -l app.kubernetes.io/name=vgpu-node-agent -o jsonpath='{.items[0].metadata.name}')
sleep 3
n=$(running_count)
after=$(kc get pods -n tenants -o jsonpath='{range .items[*]}{.status.containerStatuses[0].restartCount}{"\n"}{end}' | sort | uniq -c | tr '\n' ' ')
top=$(kc -n vgpu-system exec ds/vgpu-node-agent -c vgpu-daemon -- vgpuctl top --once 2>&1)
echo "$top" > "$W/log/vgpuctl-top-after-restart.txt"
tenants_in_top=$(echo "$top" | grep -c -E 'tenants/t[0-9]+:cuda')
bad=$(check_quotas tenants "${ITEMS[@]}")
[ $r = 0 ] && [ "$old" != "$new" ] && [ "$n" -ge 21 ] && [ "$before" = "$after" ] && [ "$tenants_in_top" -ge 20 ]
check node-agent-rolling-restart $? "pod $old -> $new in $(awk "BEGIN{printf \"%.1f\", $T_R1-$T_R}") s; tenants Running $n (20 + limited/small); restart counts before [$before] after [$after]; $tenants_in_top tenant lines in vgpuctl top after; wrong quotas $bad"

# ---- scheduler mode (b): the control plane's kube-scheduler calls the extender ----------
kc apply --validate=false -f "$ROOT/deploy/control-plane/" >/dev/null
kc -n vgpu-system get configmap vgpu-control-plane-scheduler-config -o jsonpath='{.data.kube-scheduler-config\.yaml}' > "$W/cp-scheduler.yaml"
mkdir -p "$W/cp-tls"
for f in tls.crt tls.key ca.crt; do
  kc -n vgpu-system get secret vgpu-scheduler-client-tls -o jsonpath="{.data.${f//./\\.}}" | base64 -d > "$W/cp-tls/$f"
done
# Where a control plane resolves the Service name this node has no DNS: the extender's
# address and, for its certificate, the Service name as the TLS server name.
python3 - "$W/cp-scheduler.yaml" "$KUBECONFIG" "$W/cp-tls" <<'EOF'
import sys, re
p, kubeconfig, tls = sys.argv[1:]
s = open(p).read()
s = s.replace("https://vgpu-scheduler-extender.vgpu-system.svc:8888", "https://127.0.0.1:8888")
s = s.replace("/etc/kubernetes/scheduler.conf", kubeconfig).replace("/etc/kubernetes/vgpu", tls)
s, n = re.subn(r"^( *)caFile:", r"\1serverName: vgpu-scheduler-extender.vgpu-system.svc\n\1caFile:", s, flags=re.M)
assert n == 1, s
s = s.replace("  leaderElect: true", "  leaderElect: false")
open(p, "w").write(s)
EOF
stop_pid "$PID_scheduler"
start_scheduler --config "$W/cp-scheduler.yaml"
sleep 3
: > "$W/mode-b.yaml"; ITEMS_B=()
for i in 0 1 2 3; do
  IFS=: read -r g m c <<< "${SIZES[$i]}"
  tenant "b$i" tenants default-scheduler "$g" "$m" "$c" >> "$W/mode-b.yaml"; ITEMS_B+=("b$i:$m")
done
kc delete pod -n tenants t16 t17 t18 t19 --wait=true >/dev/null
kc apply --validate=false -f "$W/mode-b.yaml" >/dev/null
wait_for 90 "4 mode-b pods Running" sh -c "[ \$('$K/kubectl' -n tenants get pods b0 b1 b2 b3 -o jsonpath='{.items[*].status.phase}' | tr ' ' '\n' | grep -c Running) = 4 ]"; r=$?
bad=$(check_quotas tenants "${ITEMS_B[@]}")
bound=$(kc -n tenants get pod b0 -o jsonpath='{.metadata.annotations}' | grep -o 'vgpu.io/[a-z-]*' | sort -u | tr '\n' ' ')
[ $r = 0 ] && [ "${bad%%/*}" = 0 ]; check scheduler-mode-b $? "default-scheduler with deploy/control-plane's extender config: b0-b3 $(kc -n tenants get pods b0 b1 b2 b3 -o jsonpath='{.items[*].status.phase}'); wrong quotas $bad; b0's annotations: $bound"

# ---- uninstall ------------------------------------------------------------------------
kc delete namespace tenants limited --wait=true --timeout=120s >/dev/null 2>&1
kc delete -f "$ROOT/deploy/control-plane/" --ignore-not-found >/dev/null 2>&1
kc delete -f "$ROOT/deploy/" --ignore-not-found --wait=true --timeout=120s > "$W/log/delete.log" 2>&1
wait_for 60 "the node agent's pod gone" sh -c "! '$K/kubectl' -n vgpu-system get pods -o name 2>/dev/null | grep -q ."
# The node steps of docs/install.md's "Uninstall".
rm -rf /sys/fs/bpf/vgpu /var/lib/vgpu
kc label node "$NODE" vgpu.io/enabled- >/dev/null
sleep 2
left=""
[ -e /var/lib/kubelet/device-plugins/vgpu.sock ] && left="$left vgpu.sock"
[ -e /sys/fs/bpf/vgpu ] && left="$left /sys/fs/bpf/vgpu"
[ -e /var/lib/vgpu ] && left="$left /var/lib/vgpu"
ls /var/lib/kubelet/device-plugins/ | grep -v -E '^(kubelet\.sock|kubelet_internal_checkpoint|DEPRECATION)$' | grep -q . && left="$left device-plugins:$(ls /var/lib/kubelet/device-plugins | tr '\n' ,)"
# Only the node's processes: other vgpu-daemons on this machine (tests) are not ours.
for p in $(pgrep -x vgpu-daemon; pgrep -x vgpu-device-plugin); do
  grep -q kubepods "/proc/$p/cgroup" 2>/dev/null && left="$left process:$p($(cat "/proc/$p/comm" 2>/dev/null))"
done
kc get crd vgpuquotapolicies.vgpu.io >/dev/null 2>&1 && left="$left crd"
kc get ns vgpu-system >/dev/null 2>&1 && [ "$(kc get ns vgpu-system -o jsonpath='{.status.phase}')" != Terminating ] && left="$left namespace"
[ -z "$left" ]; check uninstall-clean $? "after kubectl delete -f deploy/ and the documented node steps: ${left:-nothing left} (device-plugins dir: $(ls /var/lib/kubelet/device-plugins | tr '\n' ' '))"

log "checks done: $(grep -c ': PASS' "$W/summary.txt") passed, $(grep -c ': FAIL' "$W/summary.txt") failed"
cat "$W/summary.txt"
exit $FAILED
