package testproc

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// ClusterConfig describes an allocator cluster to start.
type ClusterConfig struct {
	Bin   string   // the allocator binary (Binaries.Allocator)
	Dir   string   // parent of data dirs and logs
	Size  int      // default 3
	Rules []string // rules files, given to the bootstrap node
	// Args are added to every node's flags (lease TTLs, log level...).
	Args []string
	// BootstrapArgs are added to node 0's flags only (-groups).
	BootstrapArgs []string
	// NodeArgs, when set, returns flags added to node i's only (its own
	// certificate).
	NodeArgs func(i int) []string
	// DataDir, when set, overrides node i's data directory.
	DataDir func(i int) string
	// Advertise, when set, returns the Raft address the other nodes must
	// dial to reach node i (bound at raftBind), e.g. a fault-injecting
	// proxy in front of it; it is passed as -advertise-raft-addr, so every
	// Raft connection to the node goes through it from the start.
	Advertise func(i int, raftBind string) string
	// Creds, when set, are the transport credentials of the test's own
	// gRPC clients of the nodes (default: plaintext).
	Creds credentials.TransportCredentials
}

// Node is one allocator process.
type Node struct {
	ID               string
	GRPC, Raft, HTTP string
	DataDir          string
	Proc             *Proc
	creds            credentials.TransportCredentials

	connOnce sync.Once
	conn     *grpc.ClientConn
	connErr  error
	admin    allotv1.AdminClient
	alloc    allotv1.AllocatorClient
}

// Cluster is a running allocator cluster.
type Cluster struct {
	Nodes []*Node
}

// Fast lease timing for the tests: a busy key's lease lasts 2 s, cold keys
// 4 s, grants are sized for 200 ms, expiry runs every 200 ms.
var FastLeaseArgs = []string{
	"-lease-ttl", "2s", "-max-lease-ttl", "4s", "-refresh-interval", "200ms",
	"-agent-ttl", "6s", "-expire-interval", "200ms",
}

// StartCluster starts cfg.Size allocators: node 0 bootstraps with the
// rules, the others join it. It waits until every node is ready and the
// configuration lists every member with its gRPC address.
func StartCluster(t testing.TB, cfg ClusterConfig) *Cluster {
	t.Helper()
	if cfg.Size == 0 {
		cfg.Size = 3
	}
	addrs, err := freeAddrsOn(ClusterHost(), 3*cfg.Size)
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{}
	for i := range cfg.Size {
		n := &Node{
			ID:   fmt.Sprintf("n%d", i),
			GRPC: addrs[3*i], Raft: addrs[3*i+1], HTTP: addrs[3*i+2],
			DataDir: filepath.Join(cfg.Dir, fmt.Sprintf("data-n%d", i)),
			creds:   cfg.Creds,
		}
		if cfg.DataDir != nil {
			n.DataDir = cfg.DataDir(i)
		}
		args := []string{"-node-id", n.ID, "-data-dir", n.DataDir, "-grpc-addr", n.GRPC,
			"-raft-addr", n.Raft, "-http-addr", n.HTTP, "-log-level", "info"}
		args = append(args, cfg.Args...)
		if cfg.NodeArgs != nil {
			args = append(args, cfg.NodeArgs(i)...)
		}
		if cfg.Advertise != nil {
			args = append(args, "-advertise-raft-addr", cfg.Advertise(i, n.Raft))
		}
		if i == 0 {
			args = append(args, "-bootstrap")
			args = append(args, cfg.BootstrapArgs...)
			for _, r := range cfg.Rules {
				args = append(args, "-rules", r)
			}
		} else {
			args = append(args, "-join", c.Nodes[0].GRPC)
		}
		n.Proc = NewProc("allocator-"+n.ID, cfg.Dir, cfg.Bin, args...)
		c.Nodes = append(c.Nodes, n)
	}
	for _, n := range c.Nodes {
		n.Proc.Start(t)
	}
	c.WaitReady(t, 60*time.Second)
	return c
}

// clients returns the node's (lazily created, cached) gRPC clients; the
// connection is closed by the test's cleanup.
func (n *Node) clients(t testing.TB) (allotv1.AdminClient, allotv1.AllocatorClient) {
	t.Helper()
	n.connOnce.Do(func() {
		creds := n.creds
		if creds == nil {
			creds = insecure.NewCredentials()
		}
		n.conn, n.connErr = grpc.NewClient(n.GRPC, grpc.WithTransportCredentials(creds))
		if n.connErr != nil {
			return
		}
		n.admin = allotv1.NewAdminClient(n.conn)
		n.alloc = allotv1.NewAllocatorClient(n.conn)
		conn := n.conn
		t.Cleanup(func() { conn.Close() })
	})
	if n.connErr != nil {
		t.Fatal(n.connErr)
	}
	return n.admin, n.alloc
}

// Admin is the node's Admin client.
func (n *Node) Admin(t testing.TB) allotv1.AdminClient { a, _ := n.clients(t); return a }

// Allocator is the node's Allocator client.
func (n *Node) Allocator(t testing.TB) allotv1.AllocatorClient { _, a := n.clients(t); return a }

// Ready reports the node's /readyz.
func (n *Node) Ready() bool {
	client := &http.Client{Timeout: time.Second}
	resp, err := client.Get("http://" + n.HTTP + "/readyz")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var rd struct {
		Ready bool `json:"ready"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&rd)
	client.CloseIdleConnections()
	return resp.StatusCode == http.StatusOK && rd.Ready
}

// WaitReady waits until the node's /readyz answers 200 (an error when the
// process exits first, timeout passes or ctx ends).
func (n *Node) WaitReady(ctx context.Context, timeout time.Duration) error {
	return n.Proc.WaitHTTP(ctx, "http://"+n.HTTP+"/readyz", timeout)
}

// Status asks the node for the cluster status (1 s bound).
func (n *Node) Status(t testing.TB) (*allotv1.ClusterStatusResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return n.Admin(t).ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
}

// Running returns the nodes whose process runs.
func (c *Cluster) Running() []*Node {
	var out []*Node
	for _, n := range c.Nodes {
		if n.Proc.Running() {
			out = append(out, n)
		}
	}
	return out
}

// WaitReady waits until every running node is ready and a leader lists
// every node as a member with a gRPC address.
func (c *Cluster) WaitReady(t testing.TB, within time.Duration) {
	t.Helper()
	for _, n := range c.Running() {
		Eventually(t, within, n.ID+" /readyz", n.Ready)
	}
	Eventually(t, within, fmt.Sprintf("%d members with addresses", len(c.Nodes)), func() bool {
		for _, n := range c.Running() {
			st, err := n.Status(t)
			if err != nil || st.GetLeaderId() == "" || len(st.GetMembers()) != len(c.Nodes) {
				return false
			}
			for _, m := range st.GetMembers() {
				if m.GetGrpcAddr() == "" {
					return false
				}
			}
			return true
		}
		return false
	})
}

// LeaderID asks the running nodes for the leader; "" when none knows one.
func (c *Cluster) LeaderID(t testing.TB) string {
	for _, n := range c.Running() {
		if st, err := n.Status(t); err == nil && st.GetLeaderId() != "" {
			return st.GetLeaderId()
		}
	}
	return ""
}

// Leader waits for a leader among the running nodes and returns it.
func (c *Cluster) Leader(t testing.TB, within time.Duration) *Node {
	t.Helper()
	var leader *Node
	Eventually(t, within, "a leader", func() bool {
		id := c.LeaderID(t)
		leader = c.ByID(id)
		return leader != nil && leader.Proc.Running()
	})
	return leader
}

// ByID returns the node named id, or nil.
func (c *Cluster) ByID(id string) *Node {
	for _, n := range c.Nodes {
		if n.ID == id {
			return n
		}
	}
	return nil
}

// Followers returns the running nodes other than the leader id.
func (c *Cluster) Followers(leaderID string) []*Node {
	var out []*Node
	for _, n := range c.Running() {
		if n.ID != leaderID {
			out = append(out, n)
		}
	}
	return out
}

// GRPCAddrs returns every node's gRPC address.
func (c *Cluster) GRPCAddrs() []string {
	out := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		out[i] = n.GRPC
	}
	return out
}
