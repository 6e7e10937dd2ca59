package deploy_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	ratelimitfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/allot/allot/pkg/rules"
)

const envoyPath = "envoy/envoy.yaml"

// loadEnvoy parses deploy/envoy/envoy.yaml into Envoy's Bootstrap proto
// (every typed_config resolved) and runs its generated validation.
func loadEnvoy(t *testing.T) *bootstrapv3.Bootstrap {
	t.Helper()
	var generic any
	if err := yaml.Unmarshal(readFile(t, envoyPath), &generic); err != nil {
		t.Fatalf("%s: %v", envoyPath, err)
	}
	js, err := json.Marshal(generic)
	if err != nil {
		t.Fatalf("%s: to JSON: %v", envoyPath, err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatalf("%s: not a valid Envoy v3 Bootstrap: %v", envoyPath, err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("%s: Envoy validation: %v", envoyPath, err)
	}
	return &b
}

// envoyFilters returns the HTTP connection manager of the first listener
// and its rate limit filter.
func envoyFilters(t *testing.T, b *bootstrapv3.Bootstrap) (*hcmv3.HttpConnectionManager, *ratelimitfilterv3.RateLimit) {
	t.Helper()
	var hcm hcmv3.HttpConnectionManager
	found := false
	for _, l := range b.GetStaticResources().GetListeners() {
		for _, fc := range l.GetFilterChains() {
			for _, f := range fc.GetFilters() {
				if f.GetName() == "envoy.filters.network.http_connection_manager" {
					if err := f.GetTypedConfig().UnmarshalTo(&hcm); err != nil {
						t.Fatal(err)
					}
					found = true
				}
			}
		}
	}
	if !found {
		t.Fatalf("%s: no http_connection_manager", envoyPath)
	}
	for _, f := range hcm.GetHttpFilters() {
		if f.GetName() == "envoy.filters.http.ratelimit" {
			var rl ratelimitfilterv3.RateLimit
			if err := f.GetTypedConfig().UnmarshalTo(&rl); err != nil {
				t.Fatal(err)
			}
			return &hcm, &rl
		}
	}
	t.Fatalf("%s: no envoy.filters.http.ratelimit filter", envoyPath)
	return nil, nil
}

// envoyDescriptors does what Envoy does for a request: pick the first
// route matching path, and build one descriptor per rate_limits entry from
// its actions (request_headers and generic_key, the ones the example
// uses). A descriptor with a missing header is not sent.
func envoyDescriptors(t *testing.T, hcm *hcmv3.HttpConnectionManager, path string, headers map[string]string) [][]rules.Entry {
	t.Helper()
	var route *routev3.Route
	for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
		for _, r := range vh.GetRoutes() {
			m := r.GetMatch()
			if (m.GetPath() != "" && m.GetPath() == path) || (m.GetPrefix() != "" && strings.HasPrefix(path, m.GetPrefix())) {
				route = r
				break
			}
		}
		if route != nil {
			break
		}
	}
	if route == nil {
		t.Fatalf("%s: no route matches %s", envoyPath, path)
	}
	var descs [][]rules.Entry
	for _, rl := range route.GetRoute().GetRateLimits() {
		var d []rules.Entry
		complete := true
		for _, a := range rl.GetActions() {
			switch {
			case a.GetRequestHeaders() != nil:
				rh := a.GetRequestHeaders()
				v, ok := headers[strings.ToLower(rh.GetHeaderName())]
				if !ok {
					complete = false
					continue
				}
				d = append(d, rules.Entry{Key: rh.GetDescriptorKey(), Value: v})
			case a.GetGenericKey() != nil:
				gk := a.GetGenericKey()
				key := gk.GetDescriptorKey()
				if key == "" {
					key = "generic_key"
				}
				d = append(d, rules.Entry{Key: key, Value: gk.GetDescriptorValue()})
			default:
				t.Fatalf("%s: rate_limits action %v is not modelled by this test", envoyPath, a)
			}
		}
		if complete {
			descs = append(descs, d)
		}
	}
	return descs
}

// TestEnvoyBootstrap: the Envoy example is a valid Bootstrap, its rate
// limit filter is configured as documented and points at the gateway's RLS
// port over HTTP/2, and the descriptors its actions build reach the design
// card's rules the way docs/rules.md's table says.
func TestEnvoyBootstrap(t *testing.T) {
	b := loadEnvoy(t)
	hcm, rl := envoyFilters(t, b)
	if rl.GetDomain() != "public-api" {
		t.Errorf("ratelimit domain = %q, want public-api", rl.GetDomain())
	}
	if rl.GetFailureModeDeny() {
		t.Error("failure_mode_deny = true, want false (fail open)")
	}
	if got := rl.GetTimeout().AsDuration(); got != 20*time.Millisecond {
		t.Errorf("ratelimit timeout = %v, want 20ms", got)
	}
	if rl.GetRateLimitService().GetTransportApiVersion().String() != "V3" {
		t.Errorf("rate_limit_service transport_api_version = %v, want V3", rl.GetRateLimitService().GetTransportApiVersion())
	}
	clusterName := rl.GetRateLimitService().GetGrpcService().GetEnvoyGrpc().GetClusterName()
	var rls *clusterv3.Cluster
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == clusterName {
			rls = c
		}
	}
	if rls == nil {
		t.Fatalf("rate_limit_service cluster %q is not defined", clusterName)
	}
	var opts upstreamhttpv3.HttpProtocolOptions
	anyOpts := rls.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
	if anyOpts == nil || anyOpts.UnmarshalTo(&opts) != nil || opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
		t.Errorf("cluster %s: gRPC needs explicit HTTP/2 protocol options", clusterName)
	}
	port := rls.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress().GetPortValue()
	if port != 8081 {
		t.Errorf("cluster %s port = %d, want 8081 (gateway -rls-addr default, deploy/local/cluster.sh)", clusterName, port)
	}

	set, err := rules.LoadFiles(1, "local/rules/public-api.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		path, key, tier string
		want            []string // rule names after replaces, in descriptor order
	}{
		{"/v1/search", "k_a", "free", []string{"free_search"}},
		{"/v1/other", "k_a", "free", nil},
		{"/v1/search", "k_p", "premium", []string{"premium"}},
		{"/anything", "k_p", "premium", []string{"premium"}},
		{"/v1/search", "k_live_abc123", "premium", []string{"key_override"}},
	}
	for _, c := range cases {
		descs := envoyDescriptors(t, hcm, c.path, map[string]string{"x-api-key": c.key, "x-allot-tier": c.tier})
		matched := set.MatchAll(rl.GetDomain(), descs, nil)
		var got []string
		for _, r := range matched {
			if r != nil {
				got = append(got, r.Name)
			}
		}
		if strings.Join(got, ",") != strings.Join(c.want, ",") {
			t.Errorf("%s key %s tier %s: descriptors %v match %v, want %v", c.path, c.key, c.tier, descs, got, c.want)
		}
	}
	// Without an API key nothing is sent, so nothing is limited.
	if d := envoyDescriptors(t, hcm, "/v1/search", map[string]string{"x-allot-tier": "free"}); len(d) != 0 {
		t.Errorf("without x-api-key: descriptors %v, want none", d)
	}
}
