#!/usr/bin/env bash
# Generates a least-privilege NATS deployment for one jetrl job: one user per service with only the subjects and
# JetStream API calls that service makes, a TLS CA with a server certificate for the given hosts and one client
# certificate per user, the server configuration, and per-service credential files. Needs bash and openssl (bash
# and /dev/urandom with --no-tls); no network.
#
#   deploy/nats/gen.sh [--out DIR] [--namespace NS] [--hosts h1,h2,...] [--install-dir DIR] [--store-dir DIR]
#                      [--listen ADDR] [--monitor ADDR|off] [--days N] [--rotate passwords|certs|all]
#                      [--owner UID[:GID]] [--client-dir DIR] [--cluster HOST[:PORT:ROUTE_PORT],...] [--no-tls]
#
# --hosts: the names and addresses clients reach the server by (the server certificate's names; the first one
# is the host in the generated nats.yaml URLs). Defaults: --out deploy/nats/generated, --namespace jetrl,
# --hosts 127.0.0.1,localhost,nats, --install-dir /etc/nats (where the server will read its files),
# --store-dir /data/jetstream, --listen 0.0.0.0:4222, --monitor 127.0.0.1:8222, --days 825.
# --client-dir: where clients/ will be installed (default: where it is written), for the paths in nats.yaml.
# --owner: give clients/ to this owner (root only): docker compose mounts secrets with their host owner and mode,
# and the image's jetrl user is 10001:10001 (sudo deploy/nats/gen.sh --owner 10001:10001).
# --cluster: also write one server configuration per node of a JetStream cluster (three nodes for
# nats.replicas 3): server/cluster-<node>.conf, routes to every node over TLS (port 6222 unless given; the
# nodes prove themselves with the server certificate, which names every node), JetStream in cluster
# "jetrl-<ns>", each node's store in <store-dir>/<node>. The nodes go into the server certificate, and the
# nats.yaml URLs list every node. HOST:PORT:ROUTE_PORT puts several nodes on one host (tests); such a node is
# named HOST-PORT. deploy/nats/cluster/ holds what --cluster nats-1,nats-2,nats-3 writes.
# --no-tls: users, passwords and permissions only, for a server whose clients all run on its host (`jetrl run`'s
# own server): no CA, no certificates, no tls lines, nats:// URLs; passwords cross the connection in clear text,
# so --listen must be a loopback address. Not with --cluster or --rotate certs|all.
#
# Idempotent: a second run keeps the CA, keys and passwords it finds under --out and rewrites only the
# configuration (and the server certificate when --hosts changed). --rotate makes new ones (docs/deploy.md,
# "Rotating credentials"). It prints where everything went.
#
# Layout under --out (default deploy/nats/generated, ignored by git):
#   server/nats.conf           the server configuration (listen, TLS with client verification, JetStream, auth)
#   server/cluster-<node>.conf with --cluster: node <node>'s configuration (install it as nats.conf there)
#   server/auth.conf           the job's account: users, passwords, permissions (mode 0600)
#   server/tls/                ca.pem, server.pem, server-key.pem (the server reads them from --install-dir/tls)
#   ca/ca-key.pem              the CA's key: signs new certificates; keep it off the brokers
#   clients/ca.pem             the CA every client trusts
#   clients/<user>/            password (0600), cert.pem, key.pem (0600),
#                              nats.env (JETRL__NATS__USER and __INBOX_PREFIX: not secret),
#                              nats.yaml (a job-file `nats:` section with absolute paths to these files)
# Users: trainer, rollout-worker, reward-service, replay-buffer, checkpoint-sync, status (read-only, for
# `jetrl status`) and admin (everything in the job's account: stream maintenance; keep its password offline).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/generated"
ns="jetrl"
hosts="127.0.0.1,localhost,nats"
install_dir="/etc/nats"
store_dir="/data/jetstream"
listen="0.0.0.0:4222"
monitor="127.0.0.1:8222"
days=825
rotate=""
url_host=""
owner=""
client_dir=""
cluster=""
tls=1

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit "${1:-0}"; }
die() { echo "gen.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --namespace) ns="$2"; shift 2 ;;
    --hosts) hosts="$2"; shift 2 ;;
    --install-dir) install_dir="$2"; shift 2 ;;
    --store-dir) store_dir="$2"; shift 2 ;;
    --listen) listen="$2"; shift 2 ;;
    --monitor) monitor="$2"; shift 2 ;;
    --days) days="$2"; shift 2 ;;
    --rotate) rotate="$2"; shift 2 ;;
    --owner) owner="$2"; shift 2 ;;
    --client-dir) client_dir="$2"; shift 2 ;;
    --cluster) cluster="$2"; shift 2 ;;
    --no-tls) tls=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "gen.sh: unknown argument $1" >&2; usage 2 ;;
  esac
done

[ "$tls" = 0 ] || command -v openssl >/dev/null || die "openssl not found"
[[ "$ns" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$ ]] || die "--namespace $ns: must match ^[A-Za-z0-9][A-Za-z0-9_-]{0,31}\$ (the job namespace: nats.namespace or run.name)"
[[ "$days" =~ ^[0-9]+$ ]] || die "--days $days: not a number"
case "$rotate" in ""|passwords|certs|all) ;; *) die "--rotate $rotate: expected passwords, certs or all" ;; esac
IFS=',' read -r -a host_list <<<"$hosts"
[ "${#host_list[@]}" -gt 0 ] || die "--hosts is empty"
url_host="${host_list[0]}"
listen_host="${listen%:*}"; listen_port="${listen##*:}"
if [ "$tls" = 0 ]; then
  [[ "$listen_host" =~ ^(127\.[0-9.]+|localhost|\[::1\])$ ]] \
    || die "--no-tls: --listen $listen is not a loopback address (passwords would cross the network in clear text)"
  [ -z "$cluster" ] || die "--no-tls: a cluster's routes need TLS (leave out --no-tls)"
  case "$rotate" in certs|all) die "--no-tls: there are no certificates to rotate (--rotate passwords)" ;; esac
fi
scheme=tls; [ "$tls" = 1 ] || scheme=nats

# --cluster: each node's name, host, client port and route port
node_names=(); node_hosts=(); node_ports=(); node_route_ports=()
if [ -n "$cluster" ]; then
  IFS=',' read -r -a nodes <<<"$cluster"
  [ "${#nodes[@]}" -ge 3 ] || die "--cluster $cluster: a JetStream cluster for nats.replicas 3 needs three nodes (or more)"
  for node in "${nodes[@]}"; do
    IFS=':' read -r host port route extra <<<"$node"
    [ -n "$host" ] && [ -z "$extra" ] || die "--cluster: $node is not HOST or HOST:PORT:ROUTE_PORT"
    if [ -n "$port" ]; then
      [[ "$port" =~ ^[0-9]+$ && "$route" =~ ^[0-9]+$ ]] || die "--cluster: $node is not HOST or HOST:PORT:ROUTE_PORT"
      node_names+=("$host-$port")
    else
      port="$listen_port"; route=6222
      node_names+=("$host")
    fi
    # each node checks that the certificate a route presents carries a DNS name of the routes it knows, and
    # that check ignores IP addresses
    [[ ! "$host" =~ ^[0-9.]+$ && "$host" != *:* ]] || die "--cluster: $host: give the nodes by DNS name (an IP address cannot pass the route certificate check)"
    node_hosts+=("$host"); node_ports+=("$port"); node_route_ports+=("$route")
  done
  # clients and the other nodes reach the nodes by these names
  hosts="$hosts,$(IFS=','; echo "${node_hosts[*]}")"
  IFS=',' read -r -a host_list <<<"$hosts"
fi

umask 077
mkdir -p "$out/server" "$out/clients"
[ "$tls" = 0 ] || mkdir -p "$out/server/tls" "$out/ca"
out="$(cd "$out" && pwd)"
client_dir="${client_dir:-$out/clients}"

# ---------------------------------------------------------------------------------------------------------------
# The job's names (shared/wire/src/subjects.rs `Names`): the namespace is part of every stream, bucket and
# subject, and names the account and the users, so two jobs on one server never share an identity.
S_PROMPTS="JETRL_${ns}_PROMPTS"; P_PROMPTS="jetrl.${ns}.prompts"
S_TRAJ="JETRL_${ns}_TRAJ";       P_TRAJ="jetrl.${ns}.traj"
S_SCORE="JETRL_${ns}_SCORE";     P_SCORE="jetrl.${ns}.score"
S_REWARDS="JETRL_${ns}_REWARDS"; P_REWARDS="jetrl.${ns}.rewards"
S_DLQ="JETRL_${ns}_DLQ"
S_LEDGER="JETRL_${ns}_LEDGER";   P_LEDGER="jetrl.${ns}.ledger"
KV_GROUPS="JETRL_${ns}_GROUPS"; KV_WEIGHTS="JETRL_${ns}_WEIGHTS"; KV_WORKERS="JETRL_${ns}_WORKERS"
KV_LEASE="JETRL_${ns}_LEASE"
OBJ_BLOBS="JETRL_${ns}_BLOBS"
C_ROLLOUT=rollout-workers; C_REWARD=reward-service
BUFFER="jetrl.${ns}.buffer"; ANNOUNCE="jetrl.${ns}.weights.announce"; TRAINER_METRICS="jetrl.${ns}.trainer.metrics"
CONTROL="jetrl.${ns}.control"
account="JETRL_${ns}"
user() { echo "${ns}-$1"; }
inbox() { echo "_INBOX_$(user "$1")"; }

API='$JS.API'
DATA_STREAMS=("$S_PROMPTS" "$S_TRAJ" "$S_SCORE" "$S_REWARDS")
ALL_STREAMS=("${DATA_STREAMS[@]}" "$S_DLQ" "$S_LEDGER" "KV_$KV_GROUPS" "KV_$KV_WEIGHTS" "KV_$KV_WORKERS" "KV_$KV_LEASE" "OBJ_$OBJ_BLOBS")

# JetStream API subjects, one helper per kind of call (see docs/deploy.md, "What each identity may do").
stream_info() { for s in "$@"; do echo "$API.STREAM.INFO.$s"; done; }
# Only the trainer declares the job's topology (shared/bus/src/topology.rs): it reads each stream's
# configuration, creates what is missing and updates what differs from what jetrl declares. No identity but
# admin may delete a stream.
declare_topology() {
  echo "$API.INFO"                               # the account's JetStream limits, read before creating a bucket
  stream_info "${ALL_STREAMS[@]}"
  for s in "${ALL_STREAMS[@]}"; do echo "$API.STREAM.CREATE.$s"; echo "$API.STREAM.UPDATE.$s"; done
}
# Every other service only reads the topology at start-up (and waits for what is missing): stream info only.
expect_topology() { stream_info "${ALL_STREAMS[@]}"; }
# a durable work-sharing pull consumer: create (idempotent) or update it, pull, acknowledge
durable_consumer() { # stream durable
  echo "$API.CONSUMER.CREATE.$1.$2.>"
  echo "$API.CONSUMER.CREATE.$1.$2"
  echo "$API.CONSUMER.INFO.$1.$2"
  echo "$API.CONSUMER.MSG.NEXT.$1.$2"
  echo "\$JS.ACK.$1.$2.>"
}
# read a stream with ordered (ephemeral, server-named) consumers: KV watches and key listings, object reads,
# scans of what a stream holds
read_stream() { # stream...
  for s in "$@"; do
    echo "$API.CONSUMER.CREATE.$s.>"
    echo "$API.CONSUMER.CREATE.$s"
    echo "$API.CONSUMER.INFO.$s.*"
    echo "$API.CONSUMER.MSG.NEXT.$s.*"
    echo "$API.CONSUMER.DELETE.$s.*"
    echo "\$JS.FC.$s.>"                          # flow-control replies of ordered push consumers (KV watches)
  done
}
direct_get() { for s in "$@"; do echo "$API.DIRECT.GET.$s"; echo "$API.DIRECT.GET.$s.>"; echo "$API.STREAM.MSG.GET.$s"; done; }
kv_read() { for b in "$@"; do direct_get "KV_$b"; read_stream "KV_$b"; done; }
# one message read through the stream's leader (a stream without direct get: the ledger archive's last record,
# which a read of the archive must reach)
msg_get() { for s in "$@"; do echo "$API.STREAM.MSG.GET.$s"; done; }
obj_read() { for b in "$@"; do direct_get "OBJ_$b"; read_stream "OBJ_$b"; done; }
# write objects: chunks and metadata, a lookup of the name's current metadata, a purge of replaced chunks
obj_write() { for b in "$@"; do echo "\$O.$b.C.>"; echo "\$O.$b.M.>"; direct_get "OBJ_$b"; echo "$API.STREAM.PURGE.OBJ_$b"; done; }
# a service's heartbeat, under its own service's keys of WORKERS (shared/bus/src/heartbeat.rs)
heartbeat() { echo "\$KV.$KV_WORKERS.$1.>"; }
# a service's dead letters: the malformed messages it set aside (shared/bus/src/consume.rs `dead_letter`)
dead_letters() { echo "jetrl.${ns}.dlq.$1"; }

publish_allow() { # user
  case "$1" in
    trainer)
      declare_topology
      echo "$P_PROMPTS.>"                       # prompt tasks: only the trainer
      direct_get "$S_TRAJ"                      # sampled trajectories' payloads
      echo "$BUFFER.sample"; echo "$BUFFER.release"
      echo "$ANNOUNCE"                          # weight announcements: only the trainer
      echo "$CONTROL.*.pause"; echo "$CONTROL.*.resume"  # colocate_async: pause/resume its co-located worker
      echo "$TRAINER_METRICS"
      obj_write "$OBJ_BLOBS"                    # weight blobs (checkpoint-sync verifies, then announces them)
      echo "\$KV.$KV_GROUPS.>"; kv_read "$KV_GROUPS"  # group records: created pending, re-issued on resume
      echo "$P_LEDGER.>"; read_stream "$S_LEDGER"; msg_get "$S_LEDGER"  # the archived records: read on resume, amended by a rollback
      echo "\$KV.$KV_LEASE.trainer"; kv_read "$KV_LEASE"  # one trainer per job
      kv_read "$KV_WORKERS" "$KV_WEIGHTS"       # which workers run which version
      heartbeat trainer; dead_letters trainer
      ;;
    rollout-worker)
      expect_topology
      durable_consumer "$S_PROMPTS" "$C_ROLLOUT"  # prompt tasks
      echo "$P_TRAJ.>"; echo "$P_SCORE.>"         # trajectories, score requests
      direct_get "$S_TRAJ"                        # a duplicate trajectory's stored copy
      echo "\$KV.$KV_GROUPS.>"; kv_read "$KV_GROUPS"  # group status
      heartbeat rollout; dead_letters rollout
      kv_read "$KV_WEIGHTS"; obj_read "$OBJ_BLOBS"  # weights
      ;;
    reward-service)
      expect_topology
      durable_consumer "$S_SCORE" "$C_REWARD"     # score requests
      echo "$API.STREAM.PURGE.$S_SCORE"           # settled requests, purged below the ack floor
      direct_get "$S_TRAJ" "$S_REWARDS"; read_stream "$S_REWARDS"  # payloads; rewards already stored
      echo "$P_REWARDS.*.>"                       # reward batches (never the buffer's release markers)
      heartbeat reward; dead_letters reward
      ;;
    replay-buffer)
      expect_topology
      kv_read "$KV_GROUPS"                        # the group state machine's input
      echo "\$KV.$KV_GROUPS.>"                    # marks groups sampled
      echo "$P_LEDGER.>"; echo "$API.STREAM.PURGE.KV_$KV_GROUPS"  # archives retired groups, purges their keys
      read_stream "$S_REWARDS"; direct_get "$S_REWARDS"
      echo "$P_REWARDS.released"                  # release markers
      echo "$API.STREAM.PURGE.$S_REWARDS"; echo "$API.STREAM.PURGE.$S_TRAJ"  # released and evicted payloads
      heartbeat buffer; dead_letters buffer
      ;;
    checkpoint-sync)
      expect_topology
      echo "\$KV.$KV_WEIGHTS.>"; kv_read "$KV_WEIGHTS"  # weight manifests: only checkpoint-sync writes them
      obj_read "$OBJ_BLOBS"; obj_write "$OBJ_BLOBS"     # verifies blobs, deletes old versions
      heartbeat checkpoint; dead_letters checkpoint
      ;;
    status)
      stream_info "${ALL_STREAMS[@]}"   # streams (the dead letters' count by service too)
      echo "$API.STREAM.NAMES"                   # the account's jobs, when asked for one that is not there
      echo "$API.CONSUMER.INFO.$S_PROMPTS.$C_ROLLOUT"; echo "$API.CONSUMER.INFO.$S_SCORE.$C_REWARD"  # lag
      kv_read "$KV_WEIGHTS" "$KV_WORKERS"
      kv_read "$KV_GROUPS"; read_stream "$S_LEDGER"; msg_get "$S_LEDGER"  # the row ledger (jetrl status --ledger): read, never written
      echo "$BUFFER.ledger"
      ;;
    admin)
      echo ">"
      ;;
  esac
}

# the JetStream advisories a service counts leader elections from (shared/bus/src/heartbeat.rs)
advisories() { echo "\$JS.EVENT.ADVISORY.*.LEADER_ELECTED.>"; echo "\$JS.EVENT.ADVISORY.*.QUORUM_LOST.>"; }

subscribe_allow() { # user
  case "$1" in
    trainer) echo "$TRAINER_METRICS"; advisories ;;   # its own step metrics, for its heartbeat
    rollout-worker) echo "$CONTROL.*.pause"; echo "$CONTROL.*.resume" ;;  # colocate_async: its trainer's requests
    reward-service) advisories ;;
    replay-buffer) echo "$BUFFER.sample"; echo "$BUFFER.release"; echo "$BUFFER.ledger"; advisories ;;
    checkpoint-sync) echo "$ANNOUNCE"; advisories ;;
    admin) echo ">" ;;
  esac
  [ "$1" = admin ] || echo "$(inbox "$1").>"
}

# services that answer core requests publish their replies to the requester's inbox
answers_requests() { case "$1" in replay-buffer|checkpoint-sync|rollout-worker) return 0 ;; *) return 1 ;; esac; }

USERS=(trainer rollout-worker reward-service replay-buffer checkpoint-sync status admin)

# ---------------------------------------------------------------------------------------------------------------
# TLS: a CA, a server certificate for --hosts, a client certificate per user (none with --no-tls).
generated=()
if [ "$tls" = 1 ]; then
  ca_key="$out/ca/ca-key.pem"; ca="$out/server/tls/ca.pem"
  new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
  sign() { # key cert cn extensions-file
    openssl req -new -key "$1" -subj "/O=jetrl/CN=$3" -out "$2.csr" 2>/dev/null
    openssl x509 -req -in "$2.csr" -CA "$ca" -CAkey "$ca_key" -CAcreateserial -CAserial "$out/ca/ca.srl" \
      -days "$days" -sha256 -extfile "$4" -out "$2" 2>/dev/null
    rm -f "$2.csr"
  }
  if [ ! -s "$ca_key" ] || [ ! -s "$ca" ] || [ "$rotate" = all ]; then
    new_key "$ca_key"
    openssl req -x509 -new -key "$ca_key" -sha256 -days "$days" -subj "/O=jetrl/CN=jetrl NATS CA ($ns)" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out "$ca" 2>/dev/null
    rm -f "$out/server/tls/server.pem" "$out"/clients/*/cert.pem
    generated+=("CA $ca")
  fi
  cp "$ca" "$out/clients/ca.pem"

  san=""
  declare -A seen_host=()
  for h in "${host_list[@]}"; do
    [ -n "$h" ] || continue
    [ -z "${seen_host[$h]:-}" ] || continue
    seen_host[$h]=1
    if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then san+="IP:$h,"; else san+="DNS:$h,"; fi
  done
  san="${san%,}"
  ext="$out/ca/server.ext"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=%s\n' "$san" >"$ext"
  if [ ! -s "$out/server/tls/server.pem" ] || [ "$(cat "$out/ca/server.hosts" 2>/dev/null)" != "$san" ] \
     || [ "$rotate" = certs ] || [ "$rotate" = all ]; then
    [ -s "$out/server/tls/server-key.pem" ] && [ "$rotate" = "" ] || new_key "$out/server/tls/server-key.pem"
    sign "$out/server/tls/server-key.pem" "$out/server/tls/server.pem" "$url_host" "$ext"
    echo "$san" >"$out/ca/server.hosts"
    generated+=("server certificate ($san)")
  fi

  client_ext="$out/ca/client.ext"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n' >"$client_ext"
fi

# 32 characters from [A-Za-z0-9]: ~190 bits, nothing the config or a shell would interpret; from the kernel's
# random source (no openssl needed)
random_password() {
  local password=""
  while [ ${#password} -lt 32 ]; do password+="$(head -c 64 /dev/urandom | LC_ALL=C tr -dc 'A-Za-z0-9')"; done
  printf '%s' "${password:0:32}"
}
secrets="the password and the TLS key are files"; [ "$tls" = 1 ] || secrets="the password is a file"
for u in "${USERS[@]}"; do
  dir="$out/clients/$u"; mkdir -p "$dir"
  if [ ! -s "$dir/password" ] || [ "$rotate" = passwords ] || [ "$rotate" = all ]; then
    random_password >"$dir/password"
    generated+=("password of $(user "$u")")
  fi
  if [ "$tls" = 1 ] && { [ ! -s "$dir/cert.pem" ] || [ "$rotate" = certs ] || [ "$rotate" = all ]; }; then
    new_key "$dir/key.pem"
    sign "$dir/key.pem" "$dir/cert.pem" "$(user "$u")" "$client_ext"
    generated+=("client certificate of $(user "$u")")
  fi
  inbox_line=""
  [ "$u" = admin ] || inbox_line="JETRL__NATS__INBOX_PREFIX=$(inbox "$u")"
  cat >"$dir/nats.env" <<EOF
# $(user "$u"): its NATS identity, not secret ($secrets next to this one)
JETRL__NATS__USER=$(user "$u")
$inbox_line
EOF
  {
    echo "# $(user "$u"): a job-file nats section using this identity's files in $client_dir/$u"
    echo "nats:"
    if [ -n "$cluster" ]; then
      urls=""
      for i in "${!node_hosts[@]}"; do urls+="$scheme://${node_hosts[$i]}:${node_ports[$i]},"; done
      echo "  url: ${urls%,}"
      echo "  replicas: 3"
    else
      echo "  url: $scheme://$url_host:${listen##*:}"
    fi
    echo "  user: $(user "$u")"
    echo "  password_file: $client_dir/$u/password"
    [ "$u" = admin ] || echo "  inbox_prefix: $(inbox "$u")"
    if [ "$tls" = 1 ]; then
      echo "  tls_ca_file: $client_dir/ca.pem"
      echo "  tls_cert_file: $client_dir/$u/cert.pem"
      echo "  tls_key_file: $client_dir/$u/key.pem"
    fi
  } >"$dir/nats.yaml"
  chmod 600 "$dir/password"
  chmod 644 "$dir/nats.env" "$dir/nats.yaml"
  [ "$tls" = 0 ] || { chmod 600 "$dir/key.pem"; chmod 644 "$dir/cert.pem"; }
done
[ "$tls" = 0 ] || chmod 644 "$ca" "$out/clients/ca.pem" "$out/server/tls/server.pem"
if [ -n "$owner" ]; then
  [[ "$owner" =~ ^[0-9]+(:[0-9]+)?$ ]] || die "--owner $owner: expected UID or UID:GID (numbers)"
  chown -R "$owner" "$out/clients" || die "--owner $owner: chown failed (run as root)"
  generated+=("owner of clients/: $owner")
fi

# ---------------------------------------------------------------------------------------------------------------
# The server configuration.
quote_list() { local first=1; while IFS= read -r line; do
  [ -n "$line" ] || continue
  [ $first -eq 1 ] || printf ', '; first=0; printf '"%s"' "$line"; done; }
{
  echo "# Generated by deploy/nats/gen.sh for job namespace \"$ns\": one user per jetrl service, least privilege."
  echo "# Regenerate rather than edit; docs/deploy.md explains every permission."
  echo "accounts {"
  echo "  \"$account\": {"
  echo "    jetstream: enabled"
  echo "    users: ["
  for u in "${USERS[@]}"; do
    echo "      {"
    echo "        user: \"$(user "$u")\", password: \"$(cat "$out/clients/$u/password")\""
    echo "        permissions: {"
    echo "          publish: { allow: [$(publish_allow "$u" | sort -u | quote_list)] }"
    echo "          subscribe: { allow: [$(subscribe_allow "$u" | sort -u | quote_list)] }"
    if answers_requests "$u"; then echo "          allow_responses: true"; fi
    echo "        }"
    echo "      }"
  done
  echo "    ]"
  echo "  }"
  echo "}"
} >"$out/server/auth.conf"
chmod 600 "$out/server/auth.conf"

monitor_line="http: $monitor"
[ "$monitor" != off ] || monitor_line="# no monitoring port (--monitor off)"
client_port="TLS with client certificates on the client port"
tls_block="tls {
  cert_file: \"$install_dir/tls/server.pem\"
  key_file: \"$install_dir/tls/server-key.pem\"
  ca_file: \"$install_dir/tls/ca.pem\"
  # every client presents a certificate signed by the job's CA, besides its password
  verify: true
  timeout: 5
}"
if [ "$tls" = 0 ]; then
  client_port="no TLS (--no-tls: loopback clients only)"
  tls_block="# no TLS (--no-tls): listens on loopback only; clients prove themselves with their password"
fi
cat >"$out/server/nats.conf" <<EOF
# Generated by deploy/nats/gen.sh for job namespace "$ns". NATS for jetrl: JetStream on, payloads up to 8 MiB
# (a 2 MB trajectory is one message), $client_port, one user per service.
# The monitoring port serves no secrets but tells who is connected: keep it on loopback (the Prometheus
# exporter shares the server's network namespace in compose).
listen: $listen
$monitor_line
max_payload: 8MB
$tls_block
jetstream {
  store_dir: "$store_dir"
  # size the stores for your trajectory volume; payloads are purged once the trainer releases a step
  max_memory_store: 1GB
  max_file_store: 100GB
}
include ./auth.conf
EOF
chmod 644 "$out/server/nats.conf"

# One configuration per node of the cluster: the same users, TLS and limits; routes between the nodes over TLS.
rm -f "$out"/server/cluster-*.conf
for i in "${!node_names[@]}"; do
  name="${node_names[$i]}"
  routes=""
  for j in "${!node_names[@]}"; do routes+="    \"tls://${node_hosts[$j]}:${node_route_ports[$j]}\""$'\n'; done
  cat >"$out/server/cluster-$name.conf" <<EOF
# Generated by deploy/nats/gen.sh --cluster for job namespace "$ns": node $name of a ${#node_names[@]}-node JetStream
# cluster (install it as $install_dir/nats.conf on $name, with auth.conf and tls/). Streams and buckets declared
# with nats.replicas 3 keep a copy on three nodes: one node may die without losing an acknowledged write.
server_name: "$name"
listen: $listen_host:${node_ports[$i]}
$monitor_line
max_payload: 8MB
tls {
  cert_file: "$install_dir/tls/server.pem"
  key_file: "$install_dir/tls/server-key.pem"
  ca_file: "$install_dir/tls/ca.pem"
  verify: true
  timeout: 5
}
cluster {
  name: "jetrl-$ns"
  listen: $listen_host:${node_route_ports[$i]}
  # every node, this one included (a node ignores the route to itself): a node that restarts finds the others
  routes: [
${routes%$'\n'}
  ]
  # routes are TLS both ways with the job's CA, and a node must present a certificate naming a host of the
  # routes above (the server certificate does), so a client's certificate cannot open a route
  tls {
    cert_file: "$install_dir/tls/server.pem"
    key_file: "$install_dir/tls/server-key.pem"
    ca_file: "$install_dir/tls/ca.pem"
    verify_cert_and_check_known_urls: true
    timeout: 5
  }
}
jetstream {
  store_dir: "$store_dir/$name"
  max_memory_store: 1GB
  max_file_store: 100GB
}
include ./auth.conf
EOF
  chmod 644 "$out/server/cluster-$name.conf"
done

echo "gen.sh: job namespace \"$ns\" (account $account), output in $out"
for g in "${generated[@]}"; do echo "  new: $g"; done
[ ${#generated[@]} -gt 0 ] || echo "  nothing new: kept the CA, keys and passwords found there (--rotate to replace them)"
if [ "$tls" = 1 ]; then
  echo "  server:  $out/server/{nats.conf,auth.conf,tls/} -> install in $install_dir (the config reads $install_dir/tls/)"
else
  echo "  server:  $out/server/{nats.conf,auth.conf} (no TLS: loopback only)"
fi
for name in "${node_names[@]}"; do echo "  node:    $out/server/cluster-$name.conf -> $install_dir/nats.conf on $name"; done
if [ "$tls" = 1 ]; then
  echo "  clients: $out/clients/<service>/{password,cert.pem,key.pem,nats.env,nats.yaml} and $out/clients/ca.pem"
  echo "  CA key:  $out/ca/ca-key.pem (signs new certificates; keep it off the brokers)"
else
  echo "  clients: $out/clients/<service>/{password,nats.env,nats.yaml}"
fi
echo "  users:   $(for u in "${USERS[@]}"; do printf '%s ' "$(user "$u")"; done)"
