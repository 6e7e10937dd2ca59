// Package rules loads allot's rate-limit rules and matches request
// descriptors against them.
//
// The file format is envoyproxy/ratelimit's YAML (one domain per file, nested
// descriptors with key, value and rate_limit), so Envoy rule files load
// unchanged and match with Envoy's semantics, plus allot's extensions inside
// rate_limit: burst, algorithm, backend, failure_mode, shards and routing.
// docs/rules.md describes the format.
//
// Compile validates a whole rule set and builds an immutable *Set; any error
// rejects the set (a *Error naming file:line and key), so a reloader keeps
// its previous Set. A *Set is safe for concurrent use and a nil *Set matches
// nothing.
//
// Most callers want Set.MatchAll (every descriptor of one request, with
// `replaces` applied) and KeyHash (the budget's 64-bit id); both run without
// allocating. AppendKey renders the canonical budget key
// "domain:k1=v1,k2=v2" that KeyHash hashes, and ParseKey inverts it.
package rules
