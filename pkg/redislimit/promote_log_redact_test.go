package redislimit

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/allot/allot/pkg/rules"
)

// A failed promotion is logged with the budget key redacted: the key
// carries the API key.
func TestPromoteFailureLogRedactsKey(t *testing.T) {
	set, err := rules.Compile(1, []rules.File{{Name: "t.yaml", Source: []byte(`
domain: api
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 50, backend: redis}
`)}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Addrs = []string{"127.0.0.1:1"} // nothing listens
	b, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	pcfg := DefaultPromoterConfig()
	pcfg.Threshold = 1
	p, _ := NewPromoter(pcfg)
	rl := &RuleLimiter{Backend: b, Promoter: p, Logger: log}
	entries := []rules.Entry{{Key: "api_key", Value: "sk_live_SECRET123"}}
	r := set.Match("api", entries)
	key := rules.AppendKey(nil, r, "api", entries)
	for range 5 {
		_, _ = rl.AllowN(context.Background(), r, key, 1)
	}
	if !strings.Contains(buf.String(), "promoting a hot key failed") {
		t.Fatalf("no promotion failure logged:\n%s", buf.String())
	}
	if strings.Contains(buf.String(), "sk_live_SECRET123") {
		for _, l := range strings.Split(buf.String(), "\n") {
			if strings.Contains(l, "SECRET") {
				t.Errorf("raw API key in log: %s", l)
				break
			}
		}
	}
}
