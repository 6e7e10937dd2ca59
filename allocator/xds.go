package allocator

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rlconfv3 "github.com/envoyproxy/go-control-plane/ratelimit/config/ratelimit/v3"
	"go.yaml.in/yaml/v3"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// RateLimitConfigTypeURL is the xDS resource type the leader subscribes to,
// as envoyproxy/ratelimit does with CONFIG_TYPE=GRPC_XDS_SOTW.
const RateLimitConfigTypeURL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"

// XDSConfig makes the leader take its rules from an xDS server: it
// subscribes over ADS (state of the world) to RateLimitConfig resources,
// converts them to rules files (one per resource, in Envoy's rule format),
// and commits each update that changes them as a new rule version
// replacing all domains. An update that does not convert or compile is
// NACKed with the error and changes nothing. The zero value is off.
type XDSConfig struct {
	// Addr is the xDS server's host:port. Empty: off.
	Addr string
	// NodeID is the node id in the requests; empty means "allot".
	NodeID string
	// DialOptions are added to the connection (plaintext unless they set
	// credentials).
	DialOptions []grpc.DialOption
	// MinBackoff and MaxBackoff bound the jittered exponential wait before
	// a reconnect; zero means 250ms and 30s.
	MinBackoff, MaxBackoff time.Duration
	// MinInterval is the least time between two rule versions committed
	// from the stream: an update that changes the rules sooner is
	// committed (and ACKed) once it has passed, or replaced by a newer one
	// that arrived meanwhile. Every version is sent to every agent's rule
	// watch, so a server that changes its resources many times a second
	// costs the fleet one version an interval. Zero means 1s; negative,
	// none.
	MinInterval time.Duration
}

// minInterval returns MinInterval with its default.
func (c XDSConfig) minInterval() time.Duration {
	switch {
	case c.MinInterval == 0:
		return time.Second
	case c.MinInterval < 0:
		return 0
	}
	return c.MinInterval
}

func (c XDSConfig) backoff() (lo, hi time.Duration) {
	lo, hi = c.MinBackoff, c.MaxBackoff
	if lo <= 0 {
		lo = 250 * time.Millisecond
	}
	if hi < lo {
		hi = max(lo, 30*time.Second)
	}
	return lo, hi
}

// xdsFilePrefix names the rules files an xDS update produces:
// "xds:<resource name>".
const xdsFilePrefix = "xds:"

// runXDS keeps a subscription to the xDS server open until ctx ends (the
// end of this node's term as leader), reconnecting with jittered
// exponential backoff; the wait starts over once a stream has delivered
// an accepted update.
func (s *Server) runXDS(ctx context.Context) {
	lo, hi := s.cfg.RulesXDS.backoff()
	wait := lo
	for ctx.Err() == nil {
		accepted, err := s.xdsStream(ctx)
		if ctx.Err() != nil {
			return
		}
		if accepted {
			wait = lo
		}
		d := wait/2 + rand.N(wait/2+1)
		s.log.Warn("xds: stream ended; reconnecting", "server", s.cfg.RulesXDS.Addr, "err", err, "in", d)
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(wait*2, hi)
	}
}

// xdsStream runs one ADS stream: it subscribes, then answers every
// response with an ACK (the version applied) or a NACK (the previous
// version, and the error). It returns when the stream breaks, a commit
// fails, or ctx ends, reporting whether an update was accepted.
func (s *Server) xdsStream(ctx context.Context) (accepted bool, err error) {
	cfg := s.cfg.RulesXDS
	opts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, cfg.DialOptions...)
	cc, err := grpc.NewClient(cfg.Addr, opts...)
	if err != nil {
		return false, err
	}
	defer cc.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(cc).StreamAggregatedResources(sctx)
	if err != nil {
		return false, err
	}
	node := &corev3.Node{Id: cfg.NodeID}
	if node.Id == "" {
		node.Id = "allot"
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: RateLimitConfigTypeURL}); err != nil {
		return false, err
	}
	in := &xdsInbox{ready: make(chan struct{}, 1)}
	recvDone := make(chan struct{})
	go func() { // ends when the stream does (cancel below)
		defer close(recvDone)
		in.receive(stream)
	}()
	defer func() {
		cancel()
		<-recvDone
	}()
	version := "" // the last accepted version
	// A server may answer a NACK by sending the rejected version again at
	// once: the same rejection is logged once and answered after a growing
	// pause, so the pair does not spin.
	lo, hi := cfg.backoff()
	nacked, pause := "", lo
	every := cfg.minInterval()
	var committed time.Time // when this stream last committed a version
	var next *discoveryv3.DiscoveryResponse
	for {
		resp := next
		next = nil
		if resp == nil {
			r, err := in.next(ctx)
			if err != nil {
				return accepted, err
			}
			resp = r
		}
		reply := &discoveryv3.DiscoveryRequest{Node: node, TypeUrl: RateLimitConfigTypeURL, ResponseNonce: resp.GetNonce(), VersionInfo: version}
		files, err := xdsRuleFiles(resp)
		if err == nil {
			_, err = rules.Compile(1, files)
		}
		if err != nil {
			if resp.GetVersionInfo() == nacked {
				t := time.NewTimer(pause)
				select {
				case <-ctx.Done():
					t.Stop()
					return accepted, ctx.Err()
				case <-t.C:
				}
				pause = min(pause*2, hi)
			} else {
				nacked, pause = resp.GetVersionInfo(), lo
				s.metrics.xdsUpdates.WithLabelValues("nack").Inc()
				s.log.Warn("xds: update rejected (NACK); rules unchanged", append([]any{"version", resp.GetVersionInfo()}, errAttrs(err)...)...)
			}
			if t := resp.GetTypeUrl(); t != RateLimitConfigTypeURL {
				reply.TypeUrl = t
			}
			reply.ErrorDetail = &statuspb.Status{Code: int32(codes.InvalidArgument), Message: err.Error()}
		} else {
			if wait := time.Until(committed.Add(every)); wait > 0 && !sameRuleFiles(s.st.RuleSet().GetFiles(), files) {
				t := time.NewTimer(wait)
				select {
				case <-ctx.Done():
					t.Stop()
					return accepted, ctx.Err()
				case <-t.C:
				}
				if r := in.take(); r != nil {
					// A newer state of the world replaces this one, which
					// is neither committed nor answered: the reply to the
					// newer one, with its nonce, answers both.
					next = r
					continue
				}
			}
			changed, err := s.commitXDSRules(files)
			if err != nil {
				return accepted, fmt.Errorf("commit: %w", err) // no ACK: the server resends on the next stream
			}
			s.metrics.xdsUpdates.WithLabelValues("ack").Inc()
			if changed {
				committed = time.Now()
				s.log.Info("xds: rules committed", "version", resp.GetVersionInfo(), "files", len(files), "rules_version", s.rulesVersion())
			}
			version, accepted, nacked = resp.GetVersionInfo(), true, ""
			reply.VersionInfo = version
		}
		if err := stream.Send(reply); err != nil {
			return accepted, err
		}
	}
}

// xdsInbox holds the newest response a stream has delivered and not yet
// taken, so that responses arriving while the loop waits out
// MinInterval replace each other instead of queueing.
type xdsInbox struct {
	mu    sync.Mutex // guards resp and err
	resp  *discoveryv3.DiscoveryResponse
	err   error
	ready chan struct{} // capacity 1: something to take
}

// receive reads the stream until it fails (its context ended, or the
// server closed it), keeping the newest response and then the error.
func (in *xdsInbox) receive(stream discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient) {
	for {
		r, err := stream.Recv()
		in.mu.Lock()
		if err != nil {
			in.err = err
		} else {
			in.resp = r
		}
		in.mu.Unlock()
		select {
		case in.ready <- struct{}{}:
		default:
		}
		if err != nil {
			return
		}
	}
}

// take returns the newest response not yet taken, or nil.
func (in *xdsInbox) take() *discoveryv3.DiscoveryResponse {
	in.mu.Lock()
	defer in.mu.Unlock()
	r := in.resp
	in.resp = nil
	return r
}

// next waits for a response and takes it; after the last one, it returns
// the stream's error (or ctx's).
func (in *xdsInbox) next(ctx context.Context) (*discoveryv3.DiscoveryResponse, error) {
	for {
		in.mu.Lock()
		r, err := in.resp, in.err
		in.resp = nil
		in.mu.Unlock()
		if r != nil {
			return r, nil
		}
		if err != nil {
			return nil, err
		}
		select {
		case <-in.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// commitXDSRules commits files as the whole rule set unless it already is
// (a new leader, or a reconnect, receives the same state again).
func (s *Server) commitXDSRules(files []rules.File) (changed bool, err error) {
	if sameRuleFiles(s.st.RuleSet().GetFiles(), files) {
		return false, nil
	}
	req := &allotv1.PutRulesRequest{ReplaceAll: true}
	for _, f := range files {
		req.Files = append(req.Files, &allotv1.RuleFile{Name: f.Name, Domain: f.Domain, Yaml: f.Source})
	}
	if _, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_PutRules{PutRules: req}}); err != nil {
		return false, err
	}
	return true, nil
}

func sameRuleFiles(cur []*allotv1.RuleFile, files []rules.File) bool {
	if len(cur) != len(files) {
		return false
	}
	for i, f := range files {
		if cur[i].GetName() != f.Name || !bytes.Equal(cur[i].GetYaml(), f.Source) {
			return false
		}
	}
	return true
}

// xdsRuleFiles converts a DiscoveryResponse's RateLimitConfig resources to
// rules files, one per resource, named "xds:<name>", in Envoy's rule
// format. Another type URL, or a resource that does not decode, is an
// error.
func xdsRuleFiles(resp *discoveryv3.DiscoveryResponse) ([]rules.File, error) {
	if t := resp.GetTypeUrl(); t != RateLimitConfigTypeURL {
		return nil, fmt.Errorf("xds: unexpected resource type %q (subscribed to %s)", t, RateLimitConfigTypeURL)
	}
	files := make([]rules.File, 0, len(resp.GetResources()))
	names := map[string]bool{}
	for i, a := range resp.GetResources() {
		if a.GetTypeUrl() != RateLimitConfigTypeURL {
			return nil, fmt.Errorf("xds: resource %d has type %q, want %s", i, a.GetTypeUrl(), RateLimitConfigTypeURL)
		}
		var c rlconfv3.RateLimitConfig
		if err := a.UnmarshalTo(&c); err != nil {
			return nil, fmt.Errorf("xds: resource %d: %v", i, err)
		}
		name := c.GetName()
		if name == "" {
			name = c.GetDomain()
		}
		if names[name] {
			return nil, fmt.Errorf("xds: two resources named %q", name)
		}
		names[name] = true
		src, err := rateLimitConfigYAML(&c)
		if err != nil {
			return nil, fmt.Errorf("xds: %s: %v", name, err)
		}
		files = append(files, rules.File{Name: xdsFilePrefix + name, Domain: c.GetDomain(), Source: src})
	}
	return files, nil
}

// The rules YAML of a RateLimitConfig (Envoy's format; field names as
// envoyproxy/ratelimit's config files).
type (
	yamlConfig struct {
		Domain      string           `yaml:"domain"`
		Descriptors []yamlDescriptor `yaml:"descriptors,omitempty"`
	}
	yamlDescriptor struct {
		Key            string           `yaml:"key"`
		Value          string           `yaml:"value,omitempty"`
		RateLimit      *yamlLimit       `yaml:"rate_limit,omitempty"`
		Descriptors    []yamlDescriptor `yaml:"descriptors,omitempty"`
		ShadowMode     bool             `yaml:"shadow_mode,omitempty"`
		DetailedMetric bool             `yaml:"detailed_metric,omitempty"`
	}
	yamlLimit struct {
		Unit            string        `yaml:"unit,omitempty"`
		RequestsPerUnit uint32        `yaml:"requests_per_unit,omitempty"`
		Unlimited       bool          `yaml:"unlimited,omitempty"`
		Name            string        `yaml:"name,omitempty"`
		Replaces        []yamlReplace `yaml:"replaces,omitempty"`
	}
	yamlReplace struct {
		Name string `yaml:"name"`
	}
)

// maxXDSDepth bounds the descriptor nesting of a resource.
const maxXDSDepth = 16

func rateLimitConfigYAML(c *rlconfv3.RateLimitConfig) ([]byte, error) {
	descs, err := yamlDescriptors(c.GetDescriptors(), 1)
	if err != nil {
		return nil, err
	}
	return yaml.Marshal(yamlConfig{Domain: c.GetDomain(), Descriptors: descs})
}

func yamlDescriptors(in []*rlconfv3.RateLimitDescriptor, depth int) ([]yamlDescriptor, error) {
	if len(in) == 0 {
		return nil, nil
	}
	if depth > maxXDSDepth {
		return nil, fmt.Errorf("descriptors nested deeper than %d", maxXDSDepth)
	}
	out := make([]yamlDescriptor, 0, len(in))
	for _, d := range in {
		sub, err := yamlDescriptors(d.GetDescriptors(), depth+1)
		if err != nil {
			return nil, err
		}
		yd := yamlDescriptor{Key: d.GetKey(), Value: d.GetValue(), Descriptors: sub,
			ShadowMode: d.GetShadowMode(), DetailedMetric: d.GetDetailedMetric()}
		if p := d.GetRateLimit(); p != nil {
			l := &yamlLimit{RequestsPerUnit: p.GetRequestsPerUnit(), Unlimited: p.GetUnlimited(), Name: p.GetName()}
			if !p.GetUnlimited() {
				// UNKNOWN becomes "unknown", which the rules compiler rejects.
				l.Unit = strings.ToLower(p.GetUnit().String())
			}
			for _, r := range p.GetReplaces() {
				l.Replaces = append(l.Replaces, yamlReplace{Name: r.GetName()})
			}
			yd.RateLimit = l
		}
		out = append(out, yd)
	}
	return out, nil
}
