package allocator

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/allot/allot/internal/testproc"
)

// bindAgain fails unless addr can be listened on: whoever had it let go.
func bindAgain(t *testing.T, addr string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("the Raft address %s is still bound: %v", addr, err)
	}
	ln.Close()
}

// The Raft listener is released by Shutdown, called twice, and by a start
// that fails after binding it, with no goroutine left (goleak, TestMain).
func TestRaftListenerReleased(t *testing.T) {
	tc := newTCPTestCluster(t, 1)
	s := tc.node(0)
	addr := s.RaftAddr()
	ctx := ctxT(t)
	for i := range 2 {
		if err := s.Shutdown(ctx); err != nil {
			t.Fatalf("Shutdown %d: %v", i+1, err)
		}
	}
	bindAgain(t, addr)

	// A damaged log stops the start after the listener was bound.
	cfg := tc.cfgs[0]
	cfg.RaftAddr = addr
	db := filepath.Join(cfg.DataDir, raftDBFile)
	if err := os.WriteFile(db, []byte("not a bolt file"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := New(cfg)
	for try := 0; err != nil && strings.Contains(err.Error(), "address already in use") && try < 3; try++ {
		// The port, free above, was taken meanwhile by another process
		// (tests of other packages run alongside): this start failed
		// before binding, which is not the case under test. Another one.
		cfg.RaftAddr = testproc.FreeAddr(t)
		_, err = New(cfg)
	}
	if err == nil || !strings.Contains(err.Error(), db) {
		t.Fatalf("New on a damaged %s: err = %v, want one naming it", db, err)
	}
	bindAgain(t, cfg.RaftAddr)
}
