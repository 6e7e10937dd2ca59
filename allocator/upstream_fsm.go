package allocator

import (
	"github.com/hashicorp/raft"
)

// applyUpstream applies an upstream entry of the regional ledger. One that
// does not decode, or is of a version this binary does not know, panics,
// as an undecodable Command does.
func (f *fsm) applyUpstream(l *raft.Log) any {
	res, err := f.st.ApplyUpstream(l.Data)
	if err != nil {
		stop(l, err)
	}
	return res
}
