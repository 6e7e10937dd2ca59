package regions

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// tlsNode is one allocator started with TLS; its gRPC port serves only
// TLS, so its status is read with an admin certificate.
type tlsNode struct {
	name       string
	grpc, http string
	proc       *testproc.Proc
	admin      allotv1.AdminClient
}

// startTLSNode starts a single-node cluster named name with the node's
// TLS files (client certificates required) and args, waits until it is
// ready, and connects an admin client with the admin files.
func startTLSNode(t *testing.T, bin, dir, name string, node, admin tlsconfig.Options, args ...string) *tlsNode {
	t.Helper()
	addrs := testproc.FreeAddrs(t, 3)
	n := &tlsNode{name: name, grpc: addrs[0], http: addrs[2]}
	all := []string{"-node-id", name, "-data-dir", filepath.Join(dir, "data-"+name), "-grpc-addr", addrs[0],
		"-raft-addr", addrs[1], "-http-addr", addrs[2], "-bootstrap", "-log-level", "info",
		"-tls-cert", node.CertFile, "-tls-key", node.KeyFile, "-tls-ca", node.CAFile, "-tls-client-auth", "require"}
	all = append(append(all, testproc.FastLeaseArgs...), args...)
	n.proc = testproc.NewProc("allocator-"+name, dir, bin, all...)
	n.proc.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := n.proc.WaitHTTP(ctx, "http://"+n.http+"/readyz", 60*time.Second); err != nil {
		t.Fatalf("%s not ready: %v\n%s", name, err, testproc.Tail(n.proc.Output(), 20))
	}
	l, err := tlsconfig.Load(admin)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(n.grpc, grpc.WithTransportCredentials(l.ClientCredentials("", tlsconfig.RoleAllocator)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	n.admin = allotv1.NewAdminClient(cc)
	return n
}

// upstream is the node's view of its global upstream (nil when it does
// not answer).
func (n *tlsNode) upstream() *allotv1.UpstreamStatus {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	st, err := n.admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
	if err != nil {
		return nil
	}
	return st.GetUpstream()
}

// TestRegionOverMTLS: a global cluster and two regions, every allocator
// serving gRPC over TLS with client certificates required. The region
// "good" holds an allocator certificate of the cluster's CA that the
// global cluster's -peer-names does not list: its leader leases the
// global key over mutual TLS, and its gateway admits its whole demand. The region "bad" holds an allocator certificate of another CA
// (its own CA bundle trusts both, so it verifies the global cluster): the
// global cluster refuses its handshake, the region reports cut_off with
// the TLS error in its status, and its gateway is served from the rule's
// fallback (global_fallback: static, half of R) as for any region cut off,
// with no error at either gateway.
func TestRegionOverMTLS(t *testing.T) {
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	dir := t.TempDir()
	bins := testproc.Build(t)
	ca := tlstest.NewCA(t, "allot regions CA")
	rogue := tlstest.NewCA(t, "another CA")
	bundle := filepath.Join(dir, "bundle.crt")
	if err := os.WriteFile(bundle, append(append([]byte{}, ca.PEM...), rogue.PEM...), 0o600); err != nil {
		t.Fatal(err)
	}
	issue := func(name string, by *issuer, role tlsconfig.Role, id string) tlsconfig.Options {
		o := tlstest.Files(t, dir, name, by.ca, by.ca.Issue(t, tlstest.Role(role, id)))
		o.CAFile = by.bundle
		return o
	}
	ours := &issuer{ca: ca, bundle: filepath.Join(dir, "ca.crt")}
	if err := os.WriteFile(ours.bundle, ca.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	theirs := &issuer{ca: rogue, bundle: bundle}
	admin := issue("admin", &issuer{ca: ca, bundle: bundle}, tlsconfig.RoleAdmin, "")
	rulesFile := testproc.WriteFile(t, dir, "reg.yaml", staticRules)

	// The regions' certificates come from the global cluster's CA: the
	// global node lists its own as the only node (docs/regions.md).
	global := startTLSNode(t, bins.Allocator, dir, "global", issue("global", ours, tlsconfig.RoleAllocator, "global"), admin,
		"-rules", rulesFile, "-peer-names", "global")
	good := startTLSNode(t, bins.Allocator, dir, "good", issue("good", ours, tlsconfig.RoleAllocator, ""), admin,
		"-rules", rulesFile, "-region", "good", "-global-allocators", global.grpc, "-upstream-rtt", "20ms")
	bad := startTLSNode(t, bins.Allocator, dir, "bad", issue("bad", theirs, tlsconfig.RoleAllocator, ""), admin,
		"-rules", rulesFile, "-region", "bad", "-global-allocators", global.grpc, "-upstream-rtt", "20ms")

	// A gateway in each region, with an agent certificate of the cluster's
	// CA; the bad region's gateway verifies its allocator with the bundle.
	up := testproc.StartUpstream(t)
	gateway := func(name string, n *tlsNode, caFile string) *testproc.Gateway {
		o := issue(name, ours, tlsconfig.RoleAgent, name)
		cfg := gatewayConfig(up.URL) + fmt.Sprintf("allocator_tls: {ca_file: %s, cert_file: %s, key_file: %s}\n", caFile, o.CertFile, o.KeyFile)
		g := testproc.StartGateway(t, bins.Gateway, dir, name, cfg, []string{n.grpc})
		testproc.Eventually(t, 30*time.Second, name+" /readyz", g.Ready)
		return g
	}
	goodGW := gateway("good-gw", good, ours.bundle)
	badGW := gateway("bad-gw", bad, bundle)

	start := time.Now()
	goodLoad := &testproc.Load{Proxies: []string{goodGW.Proxy}, Keys: []string{"client"}, Rate: 40}
	badLoad := &testproc.Load{Proxies: []string{badGW.Proxy}, Keys: []string{"client"}, Rate: 80}
	for _, l := range []*testproc.Load{goodLoad, badLoad} {
		l.Start()
		t.Cleanup(l.Stop)
	}
	testproc.Eventually(t, 30*time.Second, "the good region holding the global key over mTLS", func() bool {
		u := good.upstream()
		return u.GetState() == "connected" && len(u.GetKeys()) == 1 && u.GetKeys()[0].GetReceived() > 0
	})
	held := time.Now()
	testproc.Eventually(t, 30*time.Second, "6 s of load after the first grant", func() bool { return time.Since(held) > 6*time.Second })
	gl := (&gatewayLoad{start: start, loads: []*testproc.Load{goodLoad, badLoad}}).tallies(t)

	slot := 100 * time.Millisecond
	from, end := int(held.Sub(start)/slot)+10, gl[0].slots() // from a second after the first grant
	secs := float64(end-from) * slot.Seconds()
	gu, bu := good.upstream(), bad.upstream()
	ga, gOff := gl[0].sum(from, end)
	ba, bOff := gl[1].sum(from, end)
	t.Logf("good region over mTLS: state %s, admitted %d of %d in %.1f s; received %d", gu.GetState(), ga, gOff, secs,
		gu.GetKeys()[0].GetReceived())
	t.Logf("bad region: state %s, error %q; admitted %d of %d in %.1f s (%.1f/s); minted %d", bu.GetState(), bu.GetError(),
		ba, bOff, secs, float64(ba)/secs, bu.GetKeys()[0].GetMinted())

	for i, g := range []*testproc.Gateway{goodGW, badGW} {
		if n := gl[i].errs.Load(); n != 0 {
			t.Errorf("%s: %d answers other than 200 or 429", g.Name, n)
		}
		if n, err := (&region{gws: []*testproc.Gateway{g}}).limiterErrors(); err != nil || n != 0 {
			t.Errorf("%s: %v limiter errors (%v)", g.Name, n, err)
		}
	}
	if gOff == 0 || float64(ga) < 0.98*float64(gOff) {
		t.Errorf("the good region admitted %d of %d: want its whole demand (40/s, under R = %.0f/s)", ga, gOff, rate)
	}
	if bu.GetState() != "cut_off" || !strings.Contains(bu.GetError(), "certificate") {
		t.Errorf("bad region: state %q, error %q; want cut_off with the refused certificate in the error", bu.GetState(), bu.GetError())
	}
	for _, k := range bu.GetKeys() {
		if k.GetReceived() != 0 {
			t.Errorf("bad region received %d tokens from the global cluster", k.GetReceived())
		}
	}
	// The static fallback: half of R, within a tick and the gateway's
	// fallback burst.
	if got := float64(ba) / secs; got > 0.5*rate+5 || got < 0.7*0.5*rate {
		t.Errorf("bad region admitted %.1f/s, want about static_fraction × R = %.0f/s", got, 0.5*rate)
	}
	if out := bad.proc.Output(); !strings.Contains(out, "certificate") {
		t.Errorf("no log line names the refused certificate in the bad region's log:\n%s", testproc.Tail(out, 20))
	}
}

// issuer is a CA with the bundle its holders verify peers with.
type issuer struct {
	ca     *tlstest.CA
	bundle string
}
