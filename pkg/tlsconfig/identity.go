package tlsconfig

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// Role is what a certificate's holder may do in an allot deployment.
type Role string

// The roles allot issues certificates for (deploy/certs/gen-dev-certs.sh).
const (
	// RoleAgent: an agent (inside a gateway) leasing tokens as its own id.
	RoleAgent Role = "agent"
	// RoleAdmin: an operator (allotctl): rules, membership, leadership.
	RoleAdmin Role = "admin"
	// RoleAllocator: an allocator node, to its peers (Raft, forwarding,
	// join).
	RoleAllocator Role = "allocator"
	// RoleGateway: a gateway's HTTPS or RLS listener (server only).
	RoleGateway Role = "gateway"
)

// TrustDomain is the SPIFFE trust domain of allot's URI SANs:
// spiffe://allot/<role>[/<name>].
const TrustDomain = "allot"

// MaxNameLen bounds an identity's name (an agent id's first part; the
// allocator's agent_id limit is 256 bytes, which leaves room for the
// incarnation suffix).
const MaxNameLen = 128

// ErrNoIdentity: the certificate carries no allot identity (neither an
// spiffe://allot/ URI SAN nor a role OU).
var ErrNoIdentity = errors.New("tlsconfig: certificate carries no allot identity")

// Identity is the role and name a verified certificate proves. The zero
// Identity is "no identity".
type Identity struct {
	Role Role
	// Name is the agent id for RoleAgent (always set), and the optional
	// name of an admin, allocator or gateway ("" when the certificate has
	// none).
	Name string
}

// IsZero reports whether id is the zero Identity.
func (id Identity) IsZero() bool { return id.Role == "" }

// String renders id as "role" or "role/name" (the URI SAN's path).
func (id Identity) String() string {
	if id.Name == "" {
		return string(id.Role)
	}
	return string(id.Role) + "/" + id.Name
}

// ParseIdentity parses the form String produces ("agent/gw-1", "admin").
func ParseIdentity(s string) (Identity, error) {
	role, name, _ := strings.Cut(s, "/")
	return identityFrom(role, name, strings.Contains(s, "/"))
}

// Is reports whether id has one of roles.
func (id Identity) Is(roles ...Role) bool {
	for _, r := range roles {
		if id.Role == r {
			return true
		}
	}
	return false
}

// IdentityFromCert returns the identity a certificate carries. Call it only
// on a verified certificate (tls.ConnectionState.VerifiedChains[0][0]): it
// checks no signature.
//
// The URI SAN spiffe://allot/<role>[/<name>] decides when present; a
// certificate with two such SANs, or a malformed one, is an error (never a
// fallback). Without one, the subject decides: exactly one
// OrganizationalUnit naming a role, with the CommonName as the name.
// Agents must have a name; names use letters, digits, '.', '_' and '-', at
// most MaxNameLen bytes.
func IdentityFromCert(c *x509.Certificate) (Identity, error) {
	if c == nil {
		return Identity{}, ErrNoIdentity
	}
	var found []*url.URL
	for _, u := range c.URIs {
		// The trust domain matched loosely (any case, a port, a trailing
		// dot), so that a malformed allot SAN is found and refused by
		// identityFromURI rather than passed over for the subject.
		if strings.EqualFold(u.Scheme, "spiffe") && strings.EqualFold(strings.TrimSuffix(u.Hostname(), "."), TrustDomain) {
			found = append(found, u)
		}
	}
	switch len(found) {
	case 0:
	case 1:
		return identityFromURI(found[0])
	default:
		return Identity{}, fmt.Errorf("tlsconfig: certificate has %d spiffe://%s/ URI SANs, want one", len(found), TrustDomain)
	}
	var role Role
	for _, ou := range c.Subject.OrganizationalUnit {
		r := Role(ou)
		if !knownRole(r) {
			continue
		}
		if role != "" && role != r {
			return Identity{}, fmt.Errorf("tlsconfig: certificate has two role OUs (%s, %s)", role, r)
		}
		role = r
	}
	if role == "" {
		return Identity{}, ErrNoIdentity
	}
	return identityFrom(string(role), c.Subject.CommonName, c.Subject.CommonName != "")
}

func identityFromURI(u *url.URL) (Identity, error) {
	bad := func(why string) (Identity, error) {
		return Identity{}, fmt.Errorf("tlsconfig: URI SAN %q: %s", u.String(), why)
	}
	switch {
	case u.Scheme != "spiffe" || u.Host != TrustDomain:
		return bad("scheme and trust domain must be lower case spiffe://" + TrustDomain)
	case u.User != nil || u.Port() != "" || u.RawQuery != "" || u.Fragment != "" || u.RawPath != "" || u.Opaque != "":
		return bad("no user, port, query, fragment or escapes allowed")
	case !strings.HasPrefix(u.Path, "/"):
		return bad("no role in the path")
	}
	role, name, hasName := strings.Cut(u.Path[1:], "/")
	id, err := identityFrom(role, name, hasName)
	if err != nil {
		return bad(err.Error())
	}
	return id, nil
}

// identityFrom validates a role and name; hasName says a name was given
// (even empty).
func identityFrom(role, name string, hasName bool) (Identity, error) {
	r := Role(role)
	if !knownRole(r) {
		return Identity{}, fmt.Errorf("tlsconfig: unknown role %q", role)
	}
	if hasName || r == RoleAgent {
		if err := checkName(name); err != nil {
			return Identity{}, fmt.Errorf("tlsconfig: %s name: %w", r, err)
		}
	}
	return Identity{Role: r, Name: name}, nil
}

func knownRole(r Role) bool {
	switch r {
	case RoleAgent, RoleAdmin, RoleAllocator, RoleGateway:
		return true
	}
	return false
}

func checkName(name string) error {
	if name == "" {
		return errors.New("empty")
	}
	if len(name) > MaxNameLen {
		return fmt.Errorf("longer than %d bytes", MaxNameLen)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%q: use letters, digits, '.', '_' and '-'", name)
		}
	}
	return nil
}

// AgentIDMatches reports whether an Acquire's agent_id belongs to the
// agent identity name: it is name itself or name + "/" + an incarnation
// suffix.
func AgentIDMatches(agentID, name string) bool {
	if name == "" {
		return false
	}
	return agentID == name || (len(agentID) > len(name)+1 && strings.HasPrefix(agentID, name) && agentID[len(name)] == '/')
}
