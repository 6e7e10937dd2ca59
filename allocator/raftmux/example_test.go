package raftmux_test

import (
	"log"
	"time"

	"github.com/hashicorp/raft"

	"github.com/allot/allot/allocator/raftmux"
)

// One Mux per node; one Stream, and one raft.NetworkTransport over it, per
// group the node hosts. Every group's transport reports the Mux's address.
func Example() {
	m, err := raftmux.Listen("127.0.0.1:0", raftmux.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close() // closes every group's Stream too
	for _, id := range []uint32{0, 1, 2} {
		s, err := m.Group(id)
		if err != nil {
			log.Fatal(err)
		}
		trans := raft.NewNetworkTransport(s, 3, 10*time.Second, nil)
		defer trans.Close()
		_ = trans // raft.NewRaft(config, fsm, logs, stable, snaps, trans)
	}
	// Output:
}
