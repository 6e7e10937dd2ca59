package allocator

import (
	"log/slog"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// redactKey is rules.RedactKey: "key#" and 8 hex digits of the key's
// xxhash64, never the key itself.
func redactKey(key string) string { return rules.RedactKey(key) }

// redactDescriptor redacts the canonical key of domain and entries.
func redactDescriptor(domain string, entries []*allotv1.Entry) string {
	es := make([]rules.Entry, len(entries))
	for i, e := range entries {
		es[i] = rules.Entry{Key: e.GetKey(), Value: e.GetValue()}
	}
	return redactKey(string(rules.AppendKey(nil, nil, domain, es)))
}

// auditAttrs describes an admin request for the audit log without any
// descriptor value.
func auditAttrs(req any) []any {
	switch r := req.(type) {
	case *allotv1.PutRulesRequest:
		names := make([]string, len(r.GetFiles()))
		for i, f := range r.GetFiles() {
			names[i] = f.GetName()
		}
		return []any{"files", names, "replace_all", r.GetReplaceAll(), "dry_run", r.GetDryRun()}
	case *allotv1.CheckRequest:
		keys := make([]string, 0, min(len(r.GetDescriptors()), 10))
		for _, d := range r.GetDescriptors()[:min(len(r.GetDescriptors()), 10)] {
			keys = append(keys, redactDescriptor(r.GetDomain(), d.GetEntries()))
		}
		return []any{"domain", r.GetDomain(), "descriptors", len(r.GetDescriptors()), "keys", keys}
	case *allotv1.InspectKeyRequest:
		if r.GetKey() != "" {
			return []any{"key", redactKey(r.GetKey())}
		}
		return []any{"key", redactDescriptor(r.GetDomain(), r.GetEntries())}
	case *allotv1.ListLeasesRequest:
		attrs := []any{"agent_id", r.GetAgentId(), "domain", r.GetDomain()}
		if r.GetKey() != "" {
			attrs = append(attrs, "key", redactKey(r.GetKey()))
		}
		return attrs
	case *allotv1.AddVoterRequest:
		return []any{"id", r.GetId(), "raft_addr", r.GetRaftAddr()}
	case *allotv1.RemoveServerRequest:
		return []any{"id", r.GetId()}
	case *allotv1.TransferLeadershipRequest:
		return []any{"id", r.GetId()}
	}
	return nil
}

// auditLevel is the level of a call's audit line: changes at Info, reads
// at Debug.
func auditLevel(class methodClass) slog.Level {
	if class == classRead {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}
