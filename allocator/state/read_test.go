package state

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func TestListLeasesPaging(t *testing.T) {
	s := newTestState(t)
	// 3 agents × 20 keys = 60 leases.
	for i, a := range []string{"a", "b", "c"} {
		var keys []*allotv1.KeyAcquire
		for k := range 20 {
			keys = append(keys, ka("big", fmt.Sprint("k", k), 1, 0, 0, 0))
		}
		mustAcquire(t, s, at(time.Duration(i)*time.Millisecond), a, 1, keys...)
	}
	now := at(time.Second)
	seen := map[string]bool{}
	tok := ""
	pages := 0
	for {
		r, err := s.ListLeases(&allotv1.ListLeasesRequest{PageSize: 7, PageToken: tok}, now)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, l := range r.Leases {
			id := l.Key + "/" + l.AgentId
			if seen[id] {
				t.Fatalf("lease %s listed twice", id)
			}
			seen[id] = true
			if l.Tokens != 1 || l.Domain != "test" || l.Rule != "big" || l.ExpiresInMs <= 0 {
				t.Fatalf("lease = %v", l)
			}
		}
		if r.NextPageToken == "" {
			break
		}
		tok = r.NextPageToken
	}
	if len(seen) != 60 || pages != 9 {
		t.Fatalf("listed %d leases in %d pages, want 60 in 9", len(seen), pages)
	}
	r, err := s.ListLeases(&allotv1.ListLeasesRequest{AgentId: "b", PageSize: 1000}, now)
	if err != nil || len(r.Leases) != 20 {
		t.Fatalf("agent filter: %d leases, %v", len(r.Leases), err)
	}
	r, err = s.ListLeases(&allotv1.ListLeasesRequest{Key: "test:big=k3"}, now)
	if err != nil || len(r.Leases) != 3 || r.Leases[0].AgentId != "a" || r.Leases[2].AgentId != "c" {
		t.Fatalf("key filter: %v, %v", r, err)
	}
	if r, _ = s.ListLeases(&allotv1.ListLeasesRequest{Domain: "other"}, now); len(r.Leases) != 0 {
		t.Fatalf("domain filter: %v", r)
	}
	if _, err = s.ListLeases(&allotv1.ListLeasesRequest{AgentId: "zz"}, now); !errors.Is(err, ErrUnknownAgent) {
		t.Fatalf("unknown agent: %v", err)
	}
	if _, err = s.ListLeases(&allotv1.ListLeasesRequest{PageToken: "garbage"}, now); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad token: %v", err)
	}
	if r, _ = s.ListLeases(nil, now); len(r.Leases) != 60 {
		t.Fatalf("default page size: %d", len(r.Leases))
	}
}

func TestInspectKey(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(0), "a", 1, &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "slow", Value: "k1"}},
		Want: 4, Demand: 0.5, Denied: 3})
	r, err := s.InspectKey(&allotv1.InspectKeyRequest{Key: "test:slow=k1"}, at(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if !r.Matched || !r.Tracked || r.Limit.GetName() != "slow" || r.Tokens != 6 || r.FullInMs != 7000 ||
		len(r.Leases) != 1 || r.Leases[0].Tokens != 4 || r.Leases[0].AgentId != "a" || r.GrantRate <= 0 || r.DenyRate <= 0 ||
		len(r.MatchTrace) == 0 || r.NowUnixMs != at(time.Second)/1e6 {
		t.Fatalf("inspect = %v", r)
	}
	r, err = s.InspectKey(&allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: "redis", Value: "q"}}}, at(0))
	if err != nil || !r.Matched || r.Tracked || !r.RedisPromoted || r.Key != "test:redis=q" {
		t.Fatalf("inspect redis = %v, %v", r, err)
	}
	r, err = s.InspectKey(&allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: "tb", Value: "never"}}}, at(0))
	if err != nil || r.Tracked || r.Tokens != 10 {
		t.Fatalf("inspect untracked = %v, %v", r, err)
	}
	r, err = s.InspectKey(&allotv1.InspectKeyRequest{Key: "test:nope=1"}, at(0))
	if err != nil || r.Matched || len(r.MatchTrace) == 0 {
		t.Fatalf("inspect unmatched = %v, %v", r, err)
	}
	if _, err = s.InspectKey(&allotv1.InspectKeyRequest{Key: "no-colon"}, at(0)); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad key: %v", err)
	}
}

func TestTopKeys(t *testing.T) {
	s := newTestState(t)
	for i := range 30 {
		keys := []*allotv1.KeyAcquire{ka("big", fmt.Sprint("k", i), int64(i+1), 0, 0, 0)}
		keys[0].Denied = int64(30 - i)
		mustAcquire(t, s, at(0), fmt.Sprint("agent", i), 1, keys...)
	}
	r := s.TopKeys(&allotv1.TopKeysRequest{Limit: 3}, at(0))
	if len(r.Keys) != 3 || r.Keys[0].Key != "test:big=k29" || r.Keys[2].Key != "test:big=k27" || r.Keys[0].Agents != 1 {
		t.Fatalf("top by grant = %v", r.Keys)
	}
	r = s.TopKeys(&allotv1.TopKeysRequest{Order: "deny"}, at(0))
	if len(r.Keys) != 20 || r.Keys[0].Key != "test:big=k0" {
		t.Fatalf("top by deny = %v", r.Keys)
	}
	// Rates decay with time.
	later := s.TopKeys(&allotv1.TopKeysRequest{Limit: 1}, at(time.Minute))
	if later.Keys[0].GrantRate >= s.TopKeys(&allotv1.TopKeysRequest{Limit: 1}, at(0)).Keys[0].GrantRate {
		t.Fatalf("grant rate did not decay")
	}
	if r = s.TopKeys(&allotv1.TopKeysRequest{Domain: "x"}, at(0)); len(r.Keys) != 0 {
		t.Fatalf("domain filter = %v", r.Keys)
	}
	if st := s.ListAgents(at(0)); len(st.Agents) != 30 || !strings.HasPrefix(st.Agents[0].AgentId, "agent0") {
		t.Fatalf("agents = %v", st.Agents[:1])
	}
}
