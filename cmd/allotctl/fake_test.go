package main

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// fakeNow is the allocator clock of every fake response (2023-11-14T22:13:20Z).
const fakeNow = int64(1_700_000_000_000)

// fakeAdmin is an in-process Admin server with canned, deterministic
// answers. It records the requests it saw so tests can check what the CLI
// sent.
type fakeAdmin struct {
	allotv1.UnimplementedAdminServer

	mu       sync.Mutex // guards the fields below
	calls    map[string]int
	lastReq  map[string]proto.Message
	authz    []string                               // authorization metadata seen
	rules    *allotv1.RuleSet                       // GetRules answer; PutRules updates it
	putErr   error                                  // PutRules error to return, if set
	leases   []*allotv1.Lease                       // ListLeases serves these in pages of pageSize
	pageSize int                                    // 0 = all in one page
	errs     map[string]error                       // per-method error to return
	block    map[string]chan struct{}               // per-method: block until closed or ctx done
	inspect  map[string]*allotv1.InspectKeyResponse // InspectKey answers by key, ahead of the built-in ones
}

func newFakeAdmin() *fakeAdmin {
	f := &fakeAdmin{
		calls:   map[string]int{},
		lastReq: map[string]proto.Message{},
		errs:    map[string]error{},
		block:   map[string]chan struct{}{},
		rules: &allotv1.RuleSet{Version: 4, UpdatedUnixMs: fakeNow - 3_600_000, Files: []*allotv1.RuleFile{{
			Name: "public-api.yaml", Domain: "public-api", Yaml: []byte(fakeRulesYAML),
		}}},
	}
	f.leases = fakeLeases()
	return f
}

const fakeRulesYAML = `domain: public-api
descriptors:
  - key: tier
    value: free
    descriptors:
      - key: route
        value: /v1/search
        descriptors:
          - key: api_key
            rate_limit:
              name: free_search
              unit: minute
              requests_per_unit: 30
              burst: 10
`

func freeSearchLimit() *allotv1.Limit {
	return &allotv1.Limit{
		Name: "free_search", RequestsPerUnit: 30, Unit: "minute", WindowSeconds: 60, Burst: 10,
		Algorithm: "token_bucket", FailureMode: "open", Backend: "lease", Routing: "spread",
		RulePath: "tier=free/route=/v1/search/api_key",
	}
}

const fakeKey = "public-api:tier=free,route=/v1/search,api_key=k_1"

func fakeLeases() []*allotv1.Lease {
	return []*allotv1.Lease{
		{Key: fakeKey, Domain: "public-api", AgentId: "gw-a-101-x1", Tokens: 6, GrantedUnixMs: fakeNow - 1500, ExpiresInMs: 8500, Demand: 0.45, Rule: "free_search"},
		{Key: fakeKey, Domain: "public-api", AgentId: "gw-b-202-y2", Tokens: 4, GrantedUnixMs: fakeNow - 250, ExpiresInMs: 9750, Demand: 0.3, Rule: "free_search"},
		{Key: "public-api:tier=premium,api_key=k_9", Domain: "public-api", AgentId: "gw-a-101-x1", Tokens: 120, GrantedUnixMs: fakeNow - 62_000, ExpiresInMs: 0, Demand: 15.25, Rule: "premium"},
		{Key: "internal:svc=billing", Domain: "internal", AgentId: "gw-c\t303", Tokens: 1, GrantedUnixMs: fakeNow - 3_700_000, ExpiresInMs: 120_000, Demand: 0, Rule: "billing"},
	}
}

// record notes a call and returns the configured error, after blocking if
// the test asked for it.
func (f *fakeAdmin) record(ctx context.Context, method string, req proto.Message) error {
	f.mu.Lock()
	f.calls[method]++
	f.lastReq[method] = proto.Clone(req)
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		f.authz = append(f.authz, md.Get("authorization")...)
	}
	err := f.errs[method]
	block := f.block[method]
	f.mu.Unlock()
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return err
}

func (f *fakeAdmin) setErr(method string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs[method] = err
}

func (f *fakeAdmin) numCalls(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[method]
}

func (f *fakeAdmin) last(method string) proto.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastReq[method]
}

func (f *fakeAdmin) ClusterStatus(ctx context.Context, req *allotv1.ClusterStatusRequest) (*allotv1.ClusterStatusResponse, error) {
	if err := f.record(ctx, "ClusterStatus", req); err != nil {
		return nil, err
	}
	return &allotv1.ClusterStatusResponse{
		Members: []*allotv1.Member{
			{Id: "alloc-1", RaftAddr: "10.0.0.1:7421", GrpcAddr: "10.0.0.1:7420", HttpAddr: "10.0.0.1:7422", Role: "leader", Suffrage: "voter"},
			{Id: "alloc-2", RaftAddr: "10.0.0.2:7421", GrpcAddr: "10.0.0.2:7420", HttpAddr: "10.0.0.2:7422", Role: "follower", Suffrage: "voter"},
			{Id: "alloc-3", RaftAddr: "10.0.0.3:7421", GrpcAddr: "10.0.0.3:7420", Role: "follower", Suffrage: "nonvoter"},
		},
		LeaderId: "alloc-1", NodeId: "alloc-2", State: "follower", Term: 7,
		CommitIndex: 1042, AppliedIndex: 1041, LastContactMs: 42, RulesVersion: 4,
		Agents: 3, Keys: 12345, Leases: 678, LastSnapshotIndex: 1024,
	}, nil
}

func (f *fakeAdmin) ListLeases(ctx context.Context, req *allotv1.ListLeasesRequest) (*allotv1.ListLeasesResponse, error) {
	if err := f.record(ctx, "ListLeases", req); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var match []*allotv1.Lease
	for _, l := range f.leases {
		if (req.Key == "" || l.Key == req.Key) && (req.AgentId == "" || l.AgentId == req.AgentId) &&
			(req.Domain == "" || l.Domain == req.Domain) {
			match = append(match, l)
		}
	}
	start := 0
	if req.PageToken != "" {
		n, err := strconv.Atoi(req.PageToken)
		if err != nil || n < 0 || n > len(match) {
			return nil, status.Error(codes.InvalidArgument, "bad page token")
		}
		start = n
	}
	size := int(req.PageSize)
	if f.pageSize > 0 && (size == 0 || f.pageSize < size) {
		size = f.pageSize
	}
	end := len(match)
	if size > 0 && start+size < end {
		end = start + size
	}
	resp := &allotv1.ListLeasesResponse{Leases: match[start:end], NowUnixMs: fakeNow}
	if end < len(match) {
		resp.NextPageToken = strconv.Itoa(end)
	}
	return resp, nil
}

func (f *fakeAdmin) InspectKey(ctx context.Context, req *allotv1.InspectKeyRequest) (*allotv1.InspectKeyResponse, error) {
	if err := f.record(ctx, "InspectKey", req); err != nil {
		return nil, err
	}
	key := req.Key
	if key == "" {
		key = req.Domain + ":"
		for i, e := range req.Entries {
			if i > 0 {
				key += ","
			}
			key += e.Key + "=" + e.Value
		}
	}
	f.mu.Lock()
	custom := f.inspect[key]
	f.mu.Unlock()
	if custom != nil {
		return custom, nil
	}
	if key != fakeKey {
		return &allotv1.InspectKeyResponse{
			Key: key, Matched: false, NowUnixMs: fakeNow,
			MatchTrace: []string{"tier=gold: no descriptor matches at depth 1"},
		}, nil
	}
	return &allotv1.InspectKeyResponse{
		Key: fakeKey, Matched: true, Limit: freeSearchLimit(),
		MatchTrace: []string{
			"tier=free: exact value match",
			"route=/v1/search: exact value match",
			"api_key=k_1: key-only (each value has its own budget)",
		},
		Tracked: true, Tokens: 0, FullInMs: 20_000,
		Leases:    fakeLeases()[:2],
		GrantRate: 0.5, DenyRate: 3.25, NowUnixMs: fakeNow,
	}, nil
}

func (f *fakeAdmin) ListAgents(ctx context.Context, req *allotv1.ListAgentsRequest) (*allotv1.ListAgentsResponse, error) {
	if err := f.record(ctx, "ListAgents", req); err != nil {
		return nil, err
	}
	return &allotv1.ListAgentsResponse{
		Agents: []*allotv1.AgentInfo{
			{AgentId: "gw-a-101-x1", LastContactUnixMs: fakeNow - 80, KeysHeld: 2, TokensHeld: 126, FallbackKeys: 0, LastRequestId: 9123},
			{AgentId: "gw-b-202-y2", LastContactUnixMs: fakeNow - 4200, KeysHeld: 1, TokensHeld: 4, FallbackKeys: 3, LastRequestId: 77},
		},
		NowUnixMs: fakeNow,
	}, nil
}

func (f *fakeAdmin) TopKeys(ctx context.Context, req *allotv1.TopKeysRequest) (*allotv1.TopKeysResponse, error) {
	if err := f.record(ctx, "TopKeys", req); err != nil {
		return nil, err
	}
	keys := []*allotv1.KeyRate{
		{Key: "public-api:tier=premium,api_key=k_9", GrantRate: 152.4, DenyRate: 0, Tokens: 180, Agents: 2, Rule: "premium"},
		{Key: fakeKey, GrantRate: 0.5, DenyRate: 3.25, Tokens: 0, Agents: 2, Rule: "free_search"},
	}
	if req.Order == "deny" {
		keys[0], keys[1] = keys[1], keys[0]
	}
	if req.Limit > 0 && int(req.Limit) < len(keys) {
		keys = keys[:req.Limit]
	}
	return &allotv1.TopKeysResponse{Keys: keys, NowUnixMs: fakeNow}, nil
}

func (f *fakeAdmin) Check(ctx context.Context, req *allotv1.CheckRequest) (*allotv1.CheckResponse, error) {
	if err := f.record(ctx, "Check", req); err != nil {
		return nil, err
	}
	resp := &allotv1.CheckResponse{OverallCode: allotv1.Code_CODE_OK}
	for _, d := range req.Descriptors {
		st := &allotv1.DescriptorStatus{Code: allotv1.Code_CODE_OK}
		switch fmtEntries(d.Entries) {
		case "tier=free, route=/v1/search, api_key=k_1":
			st = &allotv1.DescriptorStatus{Code: allotv1.Code_CODE_OVER_LIMIT, Key: fakeKey, Matched: true,
				Limit: freeSearchLimit(), Remaining: 0, ResetAfterMs: 20_000, RetryAfterMs: 2000}
			resp.OverallCode = allotv1.Code_CODE_OVER_LIMIT
		case "api_key=k_live_abc123":
			l := &allotv1.Limit{Name: "key_override", RequestsPerUnit: 5, Unit: "minute", WindowSeconds: 60, Burst: 5,
				Algorithm: "token_bucket", ShadowMode: true, RulePath: "api_key=k_live_abc123"}
			st = &allotv1.DescriptorStatus{Code: allotv1.Code_CODE_OK, Key: "public-api:api_key=k_live_abc123", Matched: true,
				Limit: l, Remaining: 0, ResetAfterMs: 60_000, RetryAfterMs: 12_000, Shadow: true}
		}
		resp.Statuses = append(resp.Statuses, st)
	}
	return resp, nil
}

func (f *fakeAdmin) GetRules(ctx context.Context, req *allotv1.GetRulesRequest) (*allotv1.RuleSet, error) {
	if err := f.record(ctx, "GetRules", req); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return proto.Clone(f.rules).(*allotv1.RuleSet), nil
}

func (f *fakeAdmin) PutRules(ctx context.Context, req *allotv1.PutRulesRequest) (*allotv1.PutRulesResponse, error) {
	if err := f.record(ctx, "PutRules", req); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if req.ExpectedVersion != 0 && req.ExpectedVersion != f.rules.Version {
		return nil, status.Errorf(codes.FailedPrecondition, "allocator: rules version is %d, not %d", f.rules.Version, req.ExpectedVersion)
	}
	if req.DryRun {
		return &allotv1.PutRulesResponse{Version: f.rules.Version, Domains: []string{"public-api"}}, nil
	}
	f.rules.Version++
	return &allotv1.PutRulesResponse{Version: f.rules.Version, Domains: []string{"public-api"}}, nil
}

func (f *fakeAdmin) AddVoter(ctx context.Context, req *allotv1.AddVoterRequest) (*allotv1.AddVoterResponse, error) {
	if err := f.record(ctx, "AddVoter", req); err != nil {
		return nil, err
	}
	return &allotv1.AddVoterResponse{}, nil
}

func (f *fakeAdmin) RemoveServer(ctx context.Context, req *allotv1.RemoveServerRequest) (*allotv1.RemoveServerResponse, error) {
	if err := f.record(ctx, "RemoveServer", req); err != nil {
		return nil, err
	}
	return &allotv1.RemoveServerResponse{}, nil
}

func (f *fakeAdmin) TransferLeadership(ctx context.Context, req *allotv1.TransferLeadershipRequest) (*allotv1.TransferLeadershipResponse, error) {
	if err := f.record(ctx, "TransferLeadership", req); err != nil {
		return nil, err
	}
	id := req.Id
	if id == "" {
		id = "alloc-2"
	}
	return &allotv1.TransferLeadershipResponse{LeaderId: id}, nil
}

func (f *fakeAdmin) MoveSlots(ctx context.Context, req *allotv1.MoveSlotsRequest) (*allotv1.MoveSlotsResponse, error) {
	if err := f.record(ctx, "MoveSlots", req); err != nil {
		return nil, err
	}
	return &allotv1.MoveSlotsResponse{Move: &allotv1.SlotMove{
		Id: 3, Slots: req.GetSlots(), From: 1, To: req.GetTo(), Committed: true,
		StartedUnixMs: fakeNow - 42, EndedUnixMs: fakeNow, SlotMapVersion: 4,
	}}, nil
}

func (f *fakeAdmin) AddGroup(ctx context.Context, req *allotv1.AddGroupRequest) (*allotv1.AddGroupResponse, error) {
	if err := f.record(ctx, "AddGroup", req); err != nil {
		return nil, err
	}
	return &allotv1.AddGroupResponse{Id: 3, Members: []string{"alloc-1", "alloc-2", "alloc-3"}, LeaderId: "alloc-2"}, nil
}

func (f *fakeAdmin) RebalanceSlots(ctx context.Context, req *allotv1.RebalanceSlotsRequest) (*allotv1.RebalanceSlotsResponse, error) {
	if err := f.record(ctx, "RebalanceSlots", req); err != nil {
		return nil, err
	}
	return &allotv1.RebalanceSlotsResponse{Moves: []*allotv1.SlotMove{
		{Id: 4, Slots: "0-255", From: 1, To: 3, Committed: true, StartedUnixMs: fakeNow - 90, EndedUnixMs: fakeNow - 60, SlotMapVersion: 5},
		{Id: 5, Slots: "512-767", From: 2, To: 3, Committed: false, Reason: "target refused the import: the leased keys exceed the arena",
			StartedUnixMs: fakeNow - 50, EndedUnixMs: fakeNow - 20, SlotMapVersion: 5},
	}}, nil
}

// startFake serves f on a free loopback port over real gRPC and returns
// the address. creds may be nil (plaintext).
func startFake(t *testing.T, f *fakeAdmin, creds credentials.TransportCredentials) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var opts []grpc.ServerOption
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	srv := grpc.NewServer(opts...)
	allotv1.RegisterAdminServer(srv, f)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("fake admin server did not stop")
		}
	})
	return lis.Addr().String()
}
