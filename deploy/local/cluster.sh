#!/usr/bin/env bash
# cluster.sh runs a local allot cluster on loopback: three allocator nodes
# (alloc-1 bootstraps with the example rules, alloc-2 and alloc-3 join
# it), a demo upstream, and a gateway in front of the upstream whose agent
# leases tokens from the allocators.
#
#   make build                        # bin/allocator, bin/gateway, bin/allotctl
#   deploy/local/cluster.sh start     # start (or resume) everything, wait for /readyz
#   deploy/local/cluster.sh status    # processes, readiness, `allotctl status`
#   deploy/local/cluster.sh stop      # SIGTERM, wait for exit; the data is kept
#   deploy/local/cluster.sh stop alloc-3   # stop some of them (alloc-N, upstream, gateway)
#   deploy/local/cluster.sh clean     # stop, then delete the data and the logs
#
# `start` is idempotent: it starts only what is not running, and a node
# whose data directory holds Raft state resumes it (-bootstrap and -join are
# then ignored by the allocator). docs/operations.md walks through it.
#
# Environment (defaults in brackets):
#   ALLOT_LOCAL_DIR          data, logs and pid files [<repo>/.allot-local]
#   ALLOT_BIN                where allocator, gateway, allotctl are [<repo>/bin]
#   ALLOT_ALLOCATOR_PORT     gRPC port of alloc-1 [7420]; node i listens on
#                            PORT+10(i-1) for gRPC, +1 for Raft, +2 for HTTP
#   ALLOT_GATEWAY_PORT       gateway proxy port [8080]; Envoy RLS on PORT+1
#   ALLOT_GATEWAY_HTTP_PORT  gateway /metrics, /healthz, /readyz [9090]
#   ALLOT_GATEWAY_CHECK_PORT gateway POST /json and /forward-auth/ [8082]
#   ALLOT_UPSTREAM_PORT      demo upstream [8090]
#   ALLOT_UPSTREAM           an upstream URL to use instead of the demo upstream
#   ALLOT_RULES              rules file(s) for the bootstrap [deploy/local/rules/public-api.yaml]
#   ALLOT_GATEWAY_CONFIG     gateway config file [deploy/local/gateway.yaml]
#   ALLOT_READY_TIMEOUT      seconds to wait for readiness [60]
#   ALLOT_STOP_TIMEOUT       seconds to wait for a graceful exit before SIGKILL [30]
#   ALLOT_LOG_FORMAT         text or json [text]
#   ALLOT_LOG_LEVEL          debug, info, warn or error [info]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

abspath() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }

DIR=$(abspath "${ALLOT_LOCAL_DIR:-$ROOT/.allot-local}")
BIN=$(abspath "${ALLOT_BIN:-$ROOT/bin}")
ALLOCATOR_PORT=${ALLOT_ALLOCATOR_PORT:-7420}
GATEWAY_PORT=${ALLOT_GATEWAY_PORT:-8080}
GATEWAY_HTTP_PORT=${ALLOT_GATEWAY_HTTP_PORT:-9090}
GATEWAY_CHECK_PORT=${ALLOT_GATEWAY_CHECK_PORT:-8082}
UPSTREAM_PORT=${ALLOT_UPSTREAM_PORT:-8090}
UPSTREAM_URL=${ALLOT_UPSTREAM:-}
RULES=${ALLOT_RULES:-$ROOT/deploy/local/rules/public-api.yaml}
GATEWAY_CONFIG=$(abspath "${ALLOT_GATEWAY_CONFIG:-$ROOT/deploy/local/gateway.yaml}")
READY_TIMEOUT=${ALLOT_READY_TIMEOUT:-60}
STOP_TIMEOUT=${ALLOT_STOP_TIMEOUT:-30}
LOG_FORMAT=${ALLOT_LOG_FORMAT:-text}
LOG_LEVEL=${ALLOT_LOG_LEVEL:-info}

DATA=$DIR/data
LOGS=$DIR/logs
RUN=$DIR/run
NODES=(alloc-1 alloc-2 alloc-3)

die() { echo "cluster.sh: $*" >&2; exit 1; }

for v in ALLOCATOR_PORT GATEWAY_PORT GATEWAY_HTTP_PORT UPSTREAM_PORT READY_TIMEOUT STOP_TIMEOUT; do
	[[ ${!v} =~ ^[0-9]+$ ]] || die "ALLOT_$v must be a number, got '${!v}'"
done

# Addresses. Node i (1-based) uses ALLOCATOR_PORT + 10(i-1) + {0 gRPC, 1 Raft, 2 HTTP}.
node_index() { echo "${1#alloc-}"; }
node_port() { echo $((ALLOCATOR_PORT + 10 * ($(node_index "$1") - 1) + $2)); }
grpc_addr() { echo "127.0.0.1:$(node_port "$1" 0)"; }
raft_addr() { echo "127.0.0.1:$(node_port "$1" 1)"; }
http_addr() { echo "127.0.0.1:$(node_port "$1" 2)"; }
GATEWAY_LISTEN=127.0.0.1:$GATEWAY_PORT
GATEWAY_RLS=127.0.0.1:$((GATEWAY_PORT + 1))
GATEWAY_CHECK=127.0.0.1:$GATEWAY_CHECK_PORT
GATEWAY_HTTP=127.0.0.1:$GATEWAY_HTTP_PORT
UPSTREAM_LISTEN=127.0.0.1:$UPSTREAM_PORT

# The binary a managed process runs (its comm), to recognise it by pid.
binary_of() {
	case $1 in
	alloc-[123]) echo allocator ;;
	gateway) echo gateway ;;
	upstream) echo allot-upstream ;;
	esac
}

pid_of() { [[ -s $RUN/$1.pid ]] && cat "$RUN/$1.pid"; }

# alive NAME: the pid file names a live (not zombie) process running NAME's
# binary, so a recycled pid is never signalled.
alive() {
	local pid stat comm
	pid=$(pid_of "$1") || return 1
	[[ $pid =~ ^[0-9]+$ ]] || return 1
	stat=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
	[[ $stat == Z* ]] && return 1
	comm=$(ps -o comm= -p "$pid" 2>/dev/null) || return 1
	[[ $comm == "$(binary_of "$1")" ]]
}

# launch NAME BINARY ARGS...: starts BINARY in the background, detached
# from the terminal, logging to logs/NAME.log, its pid in run/NAME.pid.
launch() {
	local name=$1
	shift
	if alive "$name"; then
		echo "  $name: already running (pid $(pid_of "$name"))"
		return 0
	fi
	echo "==== $(date '+%Y-%m-%dT%H:%M:%S%z') starting: $*" >>"$LOGS/$name.log"
	nohup "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
	echo "$!" >"$RUN/$name.pid"
	echo "  $name: started (pid $!), log $LOGS/$name.log"
}

# http_ok URL: GET URL answers 200 (curl, or wget where curl is missing).
http_ok() {
	if command -v curl >/dev/null; then
		[[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" 2>/dev/null) == 200 ]]
	else
		wget -q -O /dev/null -T 2 -t 1 "$1" 2>/dev/null
	fi
}

# wait_ready NAME URL DEADLINE: polls URL until it answers 200, NAME exits,
# or the clock passes DEADLINE (epoch seconds).
wait_ready() {
	local name=$1 url=$2 deadline=$3
	while :; do
		http_ok "$url" && return 0
		if ! alive "$name"; then
			echo "cluster.sh: $name is not running; the end of $LOGS/$name.log:" >&2
			tail -n 25 "$LOGS/$name.log" >&2 || true
			return 1
		fi
		if (($(date +%s) >= deadline)); then
			echo "cluster.sh: $name not ready at $url within ${READY_TIMEOUT}s; the end of $LOGS/$name.log:" >&2
			tail -n 25 "$LOGS/$name.log" >&2 || true
			return 1
		fi
		sleep 0.1
	done
}

start_allocator() {
	local name=$1
	local -a allocator_args=(
		-node-id "$name"
		-data-dir "$DATA/$name"
		-grpc-addr "$(grpc_addr "$name")"
		-raft-addr "$(raft_addr "$name")"
		-http-addr "$(http_addr "$name")"
		-log-format "$LOG_FORMAT"
		-log-level "$LOG_LEVEL"
	)
	if [[ $name == alloc-1 ]]; then
		# Ignored once the data dir holds Raft state.
		allocator_args+=(-bootstrap -rules "$RULES")
	else
		allocator_args+=(-join "$(grpc_addr alloc-1)")
	fi
	launch "$name" "$BIN/allocator" "${allocator_args[@]}"
}

start_upstream() {
	local bin=$DIR/bin/allot-upstream
	if [[ ! -x $bin || -n $(find "$ROOT/deploy/local/upstream" -newer "$bin" -name '*.go' 2>/dev/null) ]]; then
		command -v go >/dev/null || die "building the demo upstream needs go (or set ALLOT_UPSTREAM to an upstream URL)"
		echo "  building the demo upstream into $bin"
		(cd "$ROOT" && go build -o "$bin" ./deploy/local/upstream)
	fi
	launch upstream "$bin" -listen "$UPSTREAM_LISTEN"
}

start_gateway() {
	local allocators=()
	local n
	for n in "${NODES[@]}"; do allocators+=("$(grpc_addr "$n")"); done
	local joined
	joined=$(
		IFS=,
		echo "${allocators[*]}"
	)
	local -a gateway_args=(
		-config "$GATEWAY_CONFIG"
		-allocators "$joined"
		-upstream "$UPSTREAM_URL"
		-listen "$GATEWAY_LISTEN"
		-rls-addr "$GATEWAY_RLS"
		-check-addr "$GATEWAY_CHECK"
		-http-addr "$GATEWAY_HTTP"
		-log-format "$LOG_FORMAT"
		-log-level "$LOG_LEVEL"
	)
	launch gateway "$BIN/gateway" "${gateway_args[@]}"
}

cmd_start() {
	command -v curl >/dev/null || command -v wget >/dev/null || die "needs curl or wget"
	local b
	for b in allocator gateway allotctl; do
		[[ -x $BIN/$b ]] || die "$BIN/$b not found: run 'make build' first (or set ALLOT_BIN)"
	done
	mkdir -p "$DATA" "$LOGS" "$RUN" "$DIR/bin"
	[[ -e $DIR/.gitignore ]] || echo '*' >"$DIR/.gitignore"
	local deadline=$(($(date +%s) + READY_TIMEOUT))

	echo "allocators:"
	local n
	for n in "${NODES[@]}"; do start_allocator "$n"; done
	# All three start at once: a fresh alloc-2/alloc-3 retries its join
	# until alloc-1 leads, and a restarted cluster needs a quorum to elect.
	for n in "${NODES[@]}"; do
		wait_ready "$n" "http://$(http_addr "$n")/readyz" "$deadline" ||
			die "allocator $n did not become ready (see above); 'cluster.sh stop' stops what started"
	done
	echo "  ready: $(grpc_addr alloc-1) $(grpc_addr alloc-2) $(grpc_addr alloc-3)"

	echo "gateway:"
	if [[ -z $UPSTREAM_URL ]]; then
		start_upstream
		UPSTREAM_URL=http://$UPSTREAM_LISTEN
		wait_ready upstream "$UPSTREAM_URL/" "$deadline" || die "the demo upstream did not start"
	fi
	start_gateway
	wait_ready gateway "http://$GATEWAY_HTTP/readyz" "$deadline" ||
		die "the gateway did not become ready (see above); 'cluster.sh stop' stops what started"

	cat <<EOF
  ready: proxy http://$GATEWAY_LISTEN -> $UPSTREAM_URL, Envoy RLS $GATEWAY_RLS, metrics http://$GATEWAY_HTTP/metrics

allot local cluster is up (data and logs in $DIR).
Try:
  for i in \$(seq 12); do curl -s -o /dev/null -w '%{http_code}\n' -H 'X-API-Key: k_free_demo' http://$GATEWAY_LISTEN/v1/search; done
  curl -s http://$GATEWAY_HTTP/metrics | grep allot_gateway_requests_total
  $BIN/allotctl --addr $(grpc_addr alloc-1) status
  $BIN/allotctl --addr $(grpc_addr alloc-1) --show-keys leases
  $0 stop
EOF
}

# stop_procs NAME...: SIGTERM to each, wait for all to exit (bounded by
# STOP_TIMEOUT), SIGKILL what is left.
stop_procs() {
	local n pid
	local -a sent=()
	for n in "$@"; do
		if alive "$n"; then
			pid=$(pid_of "$n")
			kill -TERM "$pid" 2>/dev/null || true
			sent+=("$n")
			echo "  $n: SIGTERM (pid $pid)"
		fi
	done
	local deadline=$(($(date +%s) + STOP_TIMEOUT))
	for n in "${sent[@]}"; do
		while alive "$n"; do
			if (($(date +%s) >= deadline)); then
				echo "  $n: still running after ${STOP_TIMEOUT}s; SIGKILL" >&2
				kill -KILL "$(pid_of "$n")" 2>/dev/null || true
				break
			fi
			sleep 0.1
		done
		echo "  $n: stopped"
	done
	for n in "$@"; do rm -f "$RUN/$n.pid"; done
}

cmd_stop() {
	[[ -d $RUN ]] || {
		echo "nothing to stop in $DIR"
		return 0
	}
	if (($# > 0)); then
		local n
		for n in "$@"; do
			[[ -n $(binary_of "$n") ]] || die "stop: unknown process '$n' (want alloc-1..3, upstream or gateway)"
		done
		stop_procs "$@"
		return 0
	fi
	# The gateway first: on shutdown its agent hands unspent tokens back to
	# the allocators. All allocators together: a lone last node would wait
	# for a quorum that is already gone.
	stop_procs gateway upstream
	stop_procs "${NODES[@]}"
}

cmd_status() {
	local ok=0 n pid state ready url
	printf '%-9s %-8s %-8s %-9s %s\n' NAME PID STATE READY ADDRESSES
	for n in "${NODES[@]}" upstream gateway; do
		pid=$(pid_of "$n" || true)
		case $n in
		alloc-*) url=http://$(http_addr "$n")/readyz ;;
		upstream) url=http://$UPSTREAM_LISTEN/ ;;
		gateway) url=http://$GATEWAY_HTTP/readyz ;;
		esac
		if [[ $n == upstream && -z $pid && -n $UPSTREAM_URL ]]; then
			continue # an external upstream
		fi
		if alive "$n"; then
			state=running
			if http_ok "$url"; then ready=ready; else
				ready="NOT READY"
				ok=1
			fi
		else
			state=stopped ready=- ok=1
		fi
		case $n in
		alloc-*) printf '%-9s %-8s %-8s %-9s grpc %s raft %s http %s\n' "$n" "${pid:--}" "$state" "$ready" \
			"$(grpc_addr "$n")" "$(raft_addr "$n")" "$(http_addr "$n")" ;;
		upstream) printf '%-9s %-8s %-8s %-9s http://%s\n' "$n" "${pid:--}" "$state" "$ready" "$UPSTREAM_LISTEN" ;;
		gateway) printf '%-9s %-8s %-8s %-9s proxy %s rls %s http %s\n' "$n" "${pid:--}" "$state" "$ready" \
			"$GATEWAY_LISTEN" "$GATEWAY_RLS" "$GATEWAY_HTTP" ;;
		esac
	done
	for n in "${NODES[@]}"; do
		if alive "$n" && [[ -x $BIN/allotctl ]]; then
			echo
			"$BIN/allotctl" --addr "$(grpc_addr "$n")" --timeout 3s status || ok=1
			break
		fi
	done
	return $ok
}

cmd_clean() {
	cmd_stop
	rm -rf "$DATA" "$LOGS" "$RUN" "$DIR/bin"
	rm -f "$DIR/.gitignore"
	rmdir "$DIR" 2>/dev/null || true
	echo "removed $DIR"
}

case ${1:-} in
start) cmd_start ;;
stop)
	shift
	cmd_stop "$@"
	;;
status) cmd_status ;;
clean) cmd_clean ;;
*)
	echo "usage: $0 start|stop [NAME...]|status|clean   (see the comment at the top of $0)" >&2
	exit 2
	;;
esac
