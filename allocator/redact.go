package allocator

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"unicode"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/tlsconfig"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// redactKey is rules.RedactKey: "key#" and 8 hex digits of the key's
// xxhash64, never the key itself.
func redactKey(key string) string { return rules.RedactKey(key) }

// ShowKeysMetadata is the call metadata ("1") with which an admin asks
// ListLeases, TopKeys and InspectKey for raw keys (allotctl --show-keys).
// Without it, or for a caller without the admin role, every key in their
// answers is redacted (redactKey).
const ShowKeysMetadata = "x-allot-show-keys"

// showKeys reports whether the call may see raw keys: it asks for them and
// its caller holds the admin role (with authentication off, every caller
// is an admin).
func showKeys(ctx context.Context, authOn bool) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(ShowKeysMetadata); len(v) == 0 || v[0] != "1" {
		return false
	}
	if !authOn {
		return true
	}
	p, ok := principalFrom(ctx)
	return ok && p.acting().Is(tlsconfig.RoleAdmin)
}

// redactAnswer reports whether the keys of a read's answer are redacted:
// unless the call may see raw keys (showKeys), or another node forwarded
// it (a read of a group that node hosts no replica of; with
// authentication on, a node with the allocator certificate), which
// redacts the answer it merges for its caller.
func redactAnswer(ctx context.Context, authOn bool) bool {
	if showKeys(ctx, authOn) {
		return false
	}
	if !authOn {
		// Every caller may ask for raw keys (showKeys).
		return !isForwarded(ctx)
	}
	p, ok := principalFrom(ctx)
	return !ok || !p.forwarded
}

// redactLeases redacts the keys of leases in place.
func redactLeases(leases []*allotv1.Lease) {
	for _, l := range leases {
		l.Key = redactKey(l.GetKey())
	}
}

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

// errAttrs describes a failed call's error for the log without descriptor
// values (the caller still gets the whole message): a rules.Error by its
// file, line and key; any other error by its message with every quoted
// span redacted (redactQuoted), since rule and key errors quote the
// values they refuse.
func errAttrs(err error) []any {
	var re *rules.Error
	if errors.As(err, &re) {
		return []any{"file", re.File, "line", re.Line, "key", re.Key}
	}
	return []any{"err", redactQuoted(status.Convert(err).Message())}
}

// redactQuoted replaces the content of every span of msg quoted with '
// ", or ` by redactKey of it. A quote opens a span at the start or after
// a character that is not a letter or digit (an apostrophe in a word
// does not); a span that is not closed runs to the end of msg. Inside "…"
// a backslash escapes the next byte, as %q writes.
func redactQuoted(msg string) string {
	var b strings.Builder
	for i := 0; i < len(msg); {
		q := msg[i]
		opens := (q == '\'' || q == '"' || q == '`') &&
			(i == 0 || !unicode.IsLetter(rune(msg[i-1])) && !unicode.IsDigit(rune(msg[i-1])))
		if !opens {
			b.WriteByte(q)
			i++
			continue
		}
		j := i + 1
		for j < len(msg) && msg[j] != q {
			if q == '"' && msg[j] == '\\' {
				j++
			}
			j++
		}
		b.WriteByte(q)
		b.WriteString(redactKey(msg[i+1 : min(j, len(msg))]))
		if j < len(msg) {
			b.WriteByte(q)
		}
		i = j + 1
	}
	return b.String()
}

// auditLevel is the level of a call's audit line: changes at Info, reads
// at Debug.
func auditLevel(class methodClass) slog.Level {
	if class == classRead {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}
