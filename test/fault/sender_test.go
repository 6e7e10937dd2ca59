package fault

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/allot/allot/allocator/raftmux"
	"github.com/allot/allot/internal/faultnet"
)

// raftSender names the sender of real RPCs from raft.NetworkTransports
// over raftmux, through a faultnet proxy: in group 0 (no header, the
// allocator's) and in a tagged group; Isolate then cuts that sender. A
// header that does not parse or an RPC without a sender is an error.
func TestRaftSender(t *testing.T) {
	transport := func(m *raftmux.Mux, id uint32) *raft.NetworkTransport {
		s, err := m.Group(id)
		if err != nil {
			t.Fatal(err)
		}
		tr := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
			Stream: s, MaxPool: 1, Timeout: time.Second, Logger: hclog.NewNullLogger(),
		})
		t.Cleanup(func() { tr.CloseStreams(); tr.Close() })
		return tr
	}
	listen := func() *raftmux.Mux {
		m, err := raftmux.Listen("127.0.0.1:0", raftmux.Config{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	dst, src := listen(), listen()
	p, err := faultnet.New(faultnet.Config{Target: dst.Addr().String(), Identify: raftSender, IdentifyTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	for _, id := range []uint32{0, 5} {
		server, client := transport(dst, id), transport(src, id)
		stop, done := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(done)
			for {
				select {
				case rpc := <-server.Consumer():
					rpc.Respond(&raft.AppendEntriesResponse{Success: true}, nil)
				case <-stop:
					return
				}
			}
		}()
		t.Cleanup(func() { close(stop); <-done })
		sender := fmt.Sprint("n", id)
		send := func() error {
			var resp raft.AppendEntriesResponse
			return client.AppendEntries(raft.ServerID("dst"), raft.ServerAddress(p.Addr()),
				&raft.AppendEntriesRequest{RPCHeader: raft.RPCHeader{ID: []byte(sender), Addr: []byte(src.Addr().String())}, Term: 1}, &resp)
		}
		if err := send(); err != nil {
			t.Fatalf("group %d: AppendEntries through the proxy: %v", id, err)
		}
		if got := p.Senders()[sender]; got != 1 {
			t.Fatalf("group %d: proxy senders %v, want %s once", id, p.Senders(), sender)
		}
		p.Isolate(sender)
		if err := send(); err == nil {
			t.Errorf("group %d: AppendEntries got through an isolated sender", id)
		}
		p.Rejoin(sender)
	}

	for name, in := range map[string][]byte{
		"bad version":     {0xA7, 'r', 'g', 9, 0, 0, 0, 1, 0, 0x80},
		"short header":    {0xA7, 'r', 'g'},
		"no sender":       {0, 0x80},
		"tagged, no RPC":  raftmux.AppendHeader(nil, 5),
		"empty":           nil,
		"not msgpack map": {0, 0xc1},
	} {
		if got, err := raftSender(bytes.NewReader(in)); err == nil {
			t.Errorf("%s: raftSender = %q, want an error", name, got)
		}
	}
}
