package tlsconfig_test

import (
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/allot/allot/pkg/tlsconfig"
)

// TestDevCertsScript: the certificates deploy/certs/gen-dev-certs.sh makes
// load, carry the identities the allocator expects, and work for mutual
// TLS between an allocator, an agent and an admin.
func TestDevCertsScript(t *testing.T) {
	if testing.Short() {
		t.Skip("runs openssl: skipped with -short")
	}
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl not installed")
	}
	dir := t.TempDir()
	cmd := exec.Command("bash", "../../deploy/certs/gen-dev-certs.sh", dir)
	cmd.Env = append(cmd.Environ(), "ALLOT_AGENT_IDS=gw-1 gw-2")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("gen-dev-certs.sh: %v\n%s", err, out)
	}
	files := func(name string) tlsconfig.Options {
		return tlsconfig.Options{
			CAFile:   filepath.Join(dir, "ca.crt"),
			CertFile: filepath.Join(dir, name+".crt"),
			KeyFile:  filepath.Join(dir, name+".key"),
		}
	}
	for name, want := range map[string]string{
		"allocator": "allocator", "agent-gw-1": "agent/gw-1", "agent-gw-2": "agent/gw-2", "admin": "admin", "gateway": "gateway",
	} {
		id, err := load(t, files(name)).Identity()
		if err != nil || id.String() != want {
			t.Errorf("%s: identity %v, %v; want %s", name, id, err, want)
		}
	}
	srv := server(t, load(t, files("allocator")), tlsconfig.ClientAuthRequire)
	for _, name := range []string{"agent-gw-1", "admin", "allocator"} {
		cs, serr, cerr := handshake(t, srv, load(t, files(name)).Client("localhost", tlsconfig.RoleAllocator))
		if serr != nil || cerr != nil {
			t.Errorf("%s to the allocator: server %v, client %v", name, serr, cerr)
			continue
		}
		if _, err := tlsconfig.PeerIdentity(cs); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	// The gateway's certificate is for serving only: TLS refuses it as a
	// client certificate.
	if _, serr, _ := handshake(t, srv, load(t, files("gateway")).Client("localhost")); serr == nil {
		t.Error("the gateway's server certificate was accepted as a client certificate")
	}
}
