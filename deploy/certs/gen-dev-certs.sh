#!/usr/bin/env bash
# gen-dev-certs.sh makes a development CA and the certificates allot's TLS
# and mTLS (issue #8) uses, with openssl. For development and tests only:
# the CA key sits next to the certificates.
#
#   deploy/certs/gen-dev-certs.sh [OUT_DIR]      # default ./allot-dev-certs
#
# Roles are in the certificate twice, as the subject's OU and as a SPIFFE-
# style URI SAN, so a server can authorize by either:
#
#   file                      OU         URI SAN                          usage
#   ca.crt, ca.key            -          -                                signs the rest
#   allocator.crt/.key        allocator  spiffe://allot/allocator         server + client (node to node)
#   gateway.crt/.key          gateway    spiffe://allot/gateway           server (HTTPS proxy, Envoy RLS)
#   agent-<id>.crt/.key       agent      spiffe://allot/agent/<id>        client (a gateway's agent → allocators)
#   admin.crt/.key            admin      spiffe://allot/admin             client (allotctl)
#
# Server certificates name localhost, 127.0.0.1, ::1, the Kubernetes
# Service names of deploy/kubernetes, and ALLOT_CERT_HOSTS.
#
# Environment:
#   ALLOT_AGENT_IDS    agent ids to issue client certificates for [gateway-1]
#   ALLOT_CERT_HOSTS   extra SANs for the server certificates, comma-separated
#                      openssl syntax, e.g. "DNS:allot.example.com,IP:10.0.0.5"
#   ALLOT_CERT_DAYS    validity in days [30]
#
# An existing ca.key/ca.crt in OUT_DIR is reused, so running it again with
# more ALLOT_AGENT_IDS issues more certificates under the same CA.
set -euo pipefail

OUT=${1:-./allot-dev-certs}
AGENTS=${ALLOT_AGENT_IDS:-gateway-1}
EXTRA_HOSTS=${ALLOT_CERT_HOSTS:-}
DAYS=${ALLOT_CERT_DAYS:-30}

command -v openssl >/dev/null || {
	echo "gen-dev-certs.sh: needs openssl" >&2
	exit 1
}
[[ $DAYS =~ ^[0-9]+$ ]] || {
	echo "gen-dev-certs.sh: ALLOT_CERT_DAYS must be a number" >&2
	exit 1
}
umask 077
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

if [[ -s $OUT/ca.key && -s $OUT/ca.crt ]]; then
	echo "reusing the CA in $OUT"
else
	newkey "$OUT/ca.key"
	cat >"$tmp/ca.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
O = allot
CN = allot development CA
[v3_ca]
basicConstraints = critical,CA:TRUE,pathlen:0
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
CNF
	openssl req -x509 -new -key "$OUT/ca.key" -config "$tmp/ca.cnf" -extensions v3_ca \
		-days "$DAYS" -sha256 -out "$OUT/ca.crt"
	echo "CA:        $OUT/ca.crt"
fi

# issue NAME CN OU EXTENDED_KEY_USAGE SUBJECT_ALT_NAMES
issue() {
	local name=$1 cn=$2 ou=$3 eku=$4 san=$5
	newkey "$OUT/$name.key"
	openssl req -new -key "$OUT/$name.key" -subj "/O=allot/OU=$ou/CN=$cn" -out "$tmp/$name.csr"
	cat >"$tmp/$name.ext" <<EXT
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = $eku
subjectAltName = $san
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EXT
	openssl x509 -req -in "$tmp/$name.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" \
		-set_serial "0x$(openssl rand -hex 16)" -days "$DAYS" -sha256 \
		-extfile "$tmp/$name.ext" -out "$OUT/$name.crt" 2>/dev/null
	chmod 0644 "$OUT/$name.crt"
	printf '%-10s %s (%s)\n' "$ou:" "$OUT/$name.crt" "$san"
}

hosts="DNS:localhost,IP:127.0.0.1,IP:::1"
k8s="DNS:allot-allocator,DNS:allot-allocator.allot.svc,DNS:allot-allocator.allot.svc.cluster.local"
k8s="$k8s,DNS:*.allot-allocator-peers.allot.svc,DNS:*.allot-allocator-peers.allot.svc.cluster.local"
gw="DNS:allot-gateway,DNS:allot-gateway.allot.svc,DNS:allot-gateway.allot.svc.cluster.local"
extra=${EXTRA_HOSTS:+,$EXTRA_HOSTS}

issue allocator allocator allocator serverAuth,clientAuth "URI:spiffe://allot/allocator,$hosts,$k8s$extra"
issue gateway gateway gateway serverAuth "URI:spiffe://allot/gateway,$hosts,$gw$extra"
for id in $AGENTS; do
	[[ $id =~ ^[A-Za-z0-9._-]+$ ]] || {
		echo "gen-dev-certs.sh: agent id '$id': use letters, digits, '.', '_' and '-'" >&2
		exit 1
	}
	issue "agent-$id" "$id" agent clientAuth "URI:spiffe://allot/agent/$id"
done
issue admin admin admin clientAuth "URI:spiffe://allot/admin"
chmod 0644 "$OUT/ca.crt"

cat <<EOF

Use them, for example (docs/operations.md, "TLS"):
  allocator ... -tls-cert $OUT/allocator.crt -tls-key $OUT/allocator.key -tls-ca $OUT/ca.crt -raft-tls
  allotctl --tls-ca $OUT/ca.crt --tls-cert $OUT/admin.crt --tls-key $OUT/admin.key status
  gateway config: allocator_tls: {ca_file: $OUT/ca.crt, cert_file: $OUT/agent-<id>.crt, key_file: $OUT/agent-<id>.key}
                  tls: {cert_file: $OUT/gateway.crt, key_file: $OUT/gateway.key}
EOF
