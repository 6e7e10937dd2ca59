package raftmux

import (
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

// serveRPCs answers every RPC on trans until stop is closed.
func serveRPCs(trans raft.Transport, stop <-chan struct{}) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case rpc := <-trans.Consumer():
				rpc.Respond(&raft.AppendEntriesResponse{Success: true}, nil)
			case <-stop:
				return
			}
		}
	}()
	return done
}

// muxTransport returns a transport over group id of a new Mux with cfg on
// 127.0.0.1; the Mux is closed at the end of the test.
func muxTransport(tb testing.TB, id uint32, cfg Config) *raft.NetworkTransport {
	tb.Helper()
	m, err := Listen("127.0.0.1:0", cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { m.Close() })
	return groupTransport(tb, m, id)
}

// groupTransport returns a transport over group id of m.
func groupTransport(tb testing.TB, m *Mux, id uint32) *raft.NetworkTransport {
	tb.Helper()
	s, err := m.Group(id)
	if err != nil {
		tb.Fatal(err)
	}
	return raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: s, MaxPool: 3, Timeout: 5 * time.Second, Logger: hclog.NewNullLogger(),
	})
}

// BenchmarkAppendEntries times one AppendEntries RPC (a 64-entry batch of
// 100 B entries) between two transports on loopback: over a Mux's group 3
// (tagged) and group 0 (untagged), and over hashicorp/raft's own TCP
// transport, the baseline. The header costs once per pooled connection.
func BenchmarkAppendEntries(b *testing.B) {
	entries := make([]*raft.Log, 64)
	for i := range entries {
		entries[i] = &raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: make([]byte, 100)}
	}
	req := &raft.AppendEntriesRequest{RPCHeader: raft.RPCHeader{ID: []byte("a"), Addr: []byte("a")}, Term: 1, Entries: entries}
	for _, tc := range []struct {
		name string
		pair func(b *testing.B) (client, server *raft.NetworkTransport)
	}{
		{"mux-group3", func(b *testing.B) (*raft.NetworkTransport, *raft.NetworkTransport) {
			return muxTransport(b, 3, Config{}), muxTransport(b, 3, Config{})
		}},
		{"mux-group0", func(b *testing.B) (*raft.NetworkTransport, *raft.NetworkTransport) {
			return muxTransport(b, 0, Config{}), muxTransport(b, 0, Config{})
		}},
		{"bare", func(b *testing.B) (*raft.NetworkTransport, *raft.NetworkTransport) {
			var ts [2]*raft.NetworkTransport
			for i := range ts {
				t, err := raft.NewTCPTransportWithLogger("127.0.0.1:0", nil, 3, 5*time.Second, hclog.NewNullLogger())
				if err != nil {
					b.Fatal(err)
				}
				ts[i] = t
			}
			return ts[0], ts[1]
		}},
	} {
		run := func(b *testing.B, parallel bool) {
			client, server := tc.pair(b)
			stop := make(chan struct{})
			done := serveRPCs(server, stop)
			defer func() {
				client.CloseStreams()
				client.Close()
				close(stop)
				<-done
				server.CloseStreams()
				server.Close()
			}()
			call := func(b *testing.B) {
				var resp raft.AppendEntriesResponse
				if err := client.AppendEntries("b", server.LocalAddr(), req, &resp); err != nil {
					b.Error(err)
				}
			}
			call(b) // dial outside the timing
			b.ReportAllocs()
			b.ResetTimer()
			if !parallel {
				for b.Loop() {
					call(b)
				}
				return
			}
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					call(b)
				}
			})
		}
		b.Run(tc.name, func(b *testing.B) { run(b, false) })
		b.Run(tc.name+"-parallel", func(b *testing.B) { run(b, true) })
	}
}

// BenchmarkHeartbeat times one Raft heartbeat (an AppendEntries with no
// entries, as hashicorp/raft's heartbeat loop sends it) over a Mux's group
// 0, and reports the process's CPU per heartbeat, both ends summed (they
// share this process): back to back, and spaced 10 ms apart as a leader
// sends them, where each one wakes both ends from idle.
func BenchmarkHeartbeat(b *testing.B) {
	req := &raft.AppendEntriesRequest{
		RPCHeader: raft.RPCHeader{ID: []byte("n0"), Addr: []byte("127.0.0.1:7421")},
		Term:      3, Leader: []byte("127.0.0.1:7421"),
	}
	for _, gap := range []time.Duration{0, 10 * time.Millisecond} {
		name := "back-to-back"
		if gap > 0 {
			name = "every-" + gap.String()
		}
		b.Run(name, func(b *testing.B) {
			client, server := muxTransport(b, 0, Config{}), muxTransport(b, 0, Config{})
			// A follower answers heartbeats on the connection's own
			// goroutine, as raft's heartbeat handler does.
			server.SetHeartbeatHandler(func(rpc raft.RPC) {
				rpc.Respond(&raft.AppendEntriesResponse{Term: 3, Success: true}, nil)
			})
			defer func() {
				client.CloseStreams()
				client.Close()
				server.CloseStreams()
				server.Close()
			}()
			var resp raft.AppendEntriesResponse
			call := func() {
				if err := client.AppendEntries("b", server.LocalAddr(), req, &resp); err != nil {
					b.Fatal(err)
				}
			}
			call() // dial outside the timing
			b.ReportAllocs()
			cpu0 := processCPU(b)
			for b.Loop() {
				call()
				if gap > 0 {
					time.Sleep(gap)
				}
			}
			b.ReportMetric(float64((processCPU(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
		})
	}
}

// processCPU is the user and system CPU time the process has used.
func processCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
