// Package allocator is the allot cluster service: a Raft-replicated
// allocator that owns every budget key's authoritative limiter state and
// hands out leases (shares of the budget) to agents.
//
// A Server wires together:
//
//   - Raft (hashicorp/raft) with a log and stable store, bolt or raft-wal
//     (Config.LogStore; fsynced on every commit, the newest entries also
//     cached in memory for replication; logstore.go, datadir.go) and file
//     snapshots in Config.DataDir, over TCP
//     through group 0 of an allocator/raftmux listener, which speaks the
//     bare Raft protocol (node.go);
//   - the replicated state machine, an unexported raft.FSM over
//     allocator/state (fsm.go);
//   - a batcher that folds every concurrently pending Acquire into one Raft
//     entry, so the commit cost is paid per batch, not per call (batcher.go);
//   - the gRPC services Allocator (agents), Admin (operators) and the
//     standard health service (service.go, admin.go);
//   - leader forwarding: any node answers any RPC; followers forward writes
//     to the leader and serve reads from their own replica (forward.go);
//   - the leader's duties: periodic lease expiry, initial rules, member
//     registration (leader.go);
//   - with Config.Groups > 1, several Raft groups on the one Raft listener
//     and gRPC address: the meta group 0 (rules, member records, and the
//     slot map of allocator/meta, meta_fsm.go) and data groups 1..N, each
//     with its own batcher, FSM, state and leader duties over the key
//     slots it owns (groups.go); calls routed by a key's slot to its
//     group's leader (route.go); the groups' leaders spread over the nodes
//     (spread.go); slot moves driven by the meta group's leader through
//     freeze, import, commit and drop entries (moves.go); data groups
//     added to a running cluster (groups_add.go). See docs/groups.md;
//   - an HTTP server with /healthz, /readyz, /metrics and /debug/pprof/
//     (http.go, metrics.go); the metrics break an Acquire's latency down
//     by stage (handler, batcher queue, commit, FSM apply, forwarding hop);
//   - a guard in front of every gRPC call: authentication (TLS client
//     certificates with allot roles, admin bearer tokens) and authorization
//     (auth.go), then a per-agent call rate and a cap on calls in flight
//     (guard.go); TLS for gRPC and, optionally, mutual TLS for Raft
//     (allocator/raftmux). Logs carry budget keys only as redacted hashes
//     (redact.go). See docs/security.md.
//
// Most callers need DefaultConfig, New, WaitReady and Shutdown. A Server is
// safe for concurrent use.
package allocator
