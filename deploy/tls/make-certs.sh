#!/bin/sh
# Certificates of the extender's TLS (ADR 0053): one CA (kept in OUT, not in the
# cluster), the extender's server certificate, and the scheduler's client certificate.
# Writes them to OUT (default ./vgpu-tls) and, with --apply, creates the two Secrets:
#   vgpu-extender-tls          tls.crt, tls.key (server), ca.crt (verifies clients)
#   vgpu-scheduler-client-tls  tls.crt, tls.key (client), ca.crt (verifies the server)
# Needs openssl (and kubectl for --apply). Re-run before the certificates expire (DAYS,
# default 825); the extender and the scheduler read them at start: restart both.
set -eu
OUT=${OUT:-./vgpu-tls}
DAYS=${DAYS:-825}
NS=${NAMESPACE:-vgpu-system}
SVC=vgpu-scheduler-extender
mkdir -p "$OUT"
cd "$OUT"
umask 077
if [ ! -f ca.key ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout ca.key -out ca.crt -days 3650 -subj "/CN=vgpu extender CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
fi
leaf() { # name cn extendedKeyUsage [subjectAltName]
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$2"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=$3"
    [ -n "${4:-}" ] && echo "subjectAltName=$4"
  } > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -days "$DAYS" -out "$1.crt" -extfile "$1.ext"
  rm -f "$1.csr" "$1.ext"
}
leaf extender "$SVC" serverAuth "DNS:$SVC,DNS:$SVC.$NS,DNS:$SVC.$NS.svc,DNS:$SVC.$NS.svc.cluster.local"
leaf scheduler vgpu-scheduler clientAuth
echo "certificates in $(pwd)"
if [ "${1:-}" = "--apply" ]; then
  kubectl -n "$NS" create secret generic vgpu-extender-tls \
    --from-file=tls.crt=extender.crt --from-file=tls.key=extender.key --from-file=ca.crt=ca.crt \
    --dry-run=client -o yaml | kubectl apply -f -
  kubectl -n "$NS" create secret generic vgpu-scheduler-client-tls \
    --from-file=tls.crt=scheduler.crt --from-file=tls.key=scheduler.key --from-file=ca.crt=ca.crt \
    --dry-run=client -o yaml | kubectl apply -f -
fi
