package httplimit

import (
	"context"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"pgregory.net/rapid"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testproc.RemoveBuilds() // the allocator binary of TestPropertyOneRequestCannotPoison
	os.Exit(code)
}

const poisonRules = `
domain: poison
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: second, requests_per_unit: 1000000000, burst: 1000000000}
  - key: h
    rate_limit: {name: per_h, unit: second, requests_per_unit: 1000000000, burst: 1000000000}
`

const poisonExtract = `
domain: poison
api_key: {headers: [X-API-Key]}
descriptors: [[api_key], [{key: h, header: X-H}]]
`

// poisonSeeds are the values that once poisoned a gateway, or nearly do,
// and valid multi-byte text that must pass.
var poisonSeeds = []string{
	"k\xff", "k\x00", "k\r\nX-Evil: 1", "\xc0\xaf", "\xed\xa0\x80", "k\x7f", "k\u0085",
	strings.Repeat("k", DefaultMaxValueBytes+1),
	"clé", "ключ", "日本語", "🔑", "\uFFFD", "plain-key",
}

// gathered reads one sample of a gathered metric (labels as name=value).
func gathered(t testing.TB, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := label == ""
			for _, lp := range m.GetLabel() {
				if lp.GetName()+"="+lp.GetValue() == label {
					match = true
				}
			}
			if match {
				if c := m.GetCounter(); c != nil {
					return c.GetValue()
				}
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("metric %s{%s} not found", name, label)
	return 0
}

// TestPropertyOneRequestCannotPoison: random requests with arbitrary bytes
// in every descriptor source go through the real middleware, agent and a
// single-node allocator over gRPC on 127.0.0.1. A request is refused with
// a 400 exactly when one of its values is not rules.ValidText (or too
// long), and otherwise forwarded; no request changes the breaker state or
// another key's decisions (a victim key with a budget far from spent stays
// allowed, and leased at the end).
func TestPropertyOneRequestCannotPoison(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a real allocator")
	}
	logger := slog.New(slog.DiscardHandler)
	dir := t.TempDir()
	c := testproc.StartCluster(t, testproc.ClusterConfig{Bin: testproc.Build(t).Allocator, Dir: dir, Size: 1,
		Rules: []string{testproc.WriteFile(t, dir, "poison.yaml", poisonRules)}})
	srv := c.Nodes[0]
	defer func() {
		if err := srv.Proc.Signal(syscall.SIGTERM, 10*time.Second); err != nil {
			t.Errorf("allocator shutdown: %v", err)
		}
	}()

	reg := prometheus.NewRegistry()
	cfg := agent.DefaultConfig()
	cfg.Allocators = []string{srv.GRPC}
	cfg.RefillInterval = 5 * time.Millisecond
	cfg.Registerer = reg
	cfg.Logger = logger
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := a.Close(context.Background()); err != nil {
			t.Errorf("agent close: %v", err)
		}
	}()
	waitUntil(t, "agent ready", a.Ready)

	victim := []agent.Descriptor{{Entries: []rules.Entry{{Key: "api_key", Value: "victim"}}}}
	checkVictim := func() agent.Decision {
		d, err := a.Check(context.Background(), "poison", victim, 1)
		if err != nil || !d.Allowed {
			t.Fatalf("victim: %+v, %v", d, err)
		}
		return d
	}
	waitUntil(t, "a lease for the victim", func() bool { return checkVictim().Source == agent.SourceLease })

	m := &Middleware{Checker: a, Extractor: mustExtractor(t, poisonExtract), Logger: logger}
	h := m.Wrap(&upstream{})
	bad := func(v string) bool {
		v = strings.TrimSpace(v)
		return v != "" && (len(v) > DefaultMaxValueBytes || !rules.ValidText(v))
	}
	value := rapid.OneOf(rapid.SampledFrom(poisonSeeds), rapid.String(),
		rapid.Map(rapid.SliceOf(rapid.Byte()), func(b []byte) string { return string(b) }))
	rapid.Check(t, func(rt *rapid.T) {
		key := value.Draw(rt, "api_key")
		hv := value.Draw(rt, "x_h")
		r := req("GET", "/v1/search")
		r.Header["X-Api-Key"] = []string{key}
		r.Header["X-H"] = []string{hv}
		rec := serve(h, r)
		want := http.StatusOK
		if bad(key) || bad(hv) {
			want = http.StatusBadRequest
		}
		if rec.Code != want {
			rt.Fatalf("api_key %q, X-H %q: code %d, want %d (body %s)", key, hv, rec.Code, want, rec.Body)
		}
		checkVictim() // allowed: its budget is far from spent
		if open := gathered(t, reg, "allot_agent_breaker_transitions_total", "to=open"); open != 0 {
			rt.Fatalf("after api_key %q, X-H %q: the breaker opened", key, hv)
		}
	})

	// Every key the requests left in the table has been offered to the
	// allocator by now: two more successful calls after the last request.
	ok := gathered(t, reg, "allot_agent_acquire_calls_total", "result=ok")
	waitUntil(t, "Acquire calls after the last request", func() bool {
		checkVictim()
		// A fresh key each round makes the agent call.
		_, _ = a.Check(context.Background(), "poison", []agent.Descriptor{{Entries: []rules.Entry{{Key: "h", Value: time.Now().String()}}}}, 1)
		return gathered(t, reg, "allot_agent_acquire_calls_total", "result=ok") >= ok+2
	})
	if n := gathered(t, reg, "allot_agent_breaker_transitions_total", "to=open"); n != 0 {
		t.Fatalf("breaker opened %v times", n)
	}
	if n := gathered(t, reg, "allot_agent_acquire_calls_total", "result=failed"); n != 0 {
		t.Fatalf("%v Acquire calls failed", n)
	}
	if n := gathered(t, reg, "allot_agent_keys_refused_total", ""); n != 0 {
		t.Fatalf("%v keys refused: a bad value got past the boundary", n)
	}
	waitUntil(t, "the victim leased at the end", func() bool { return checkVictim().Source == agent.SourceLease })
}

func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
