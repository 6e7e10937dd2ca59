package allocator

import (
	"errors"
	"fmt"

	"github.com/hashicorp/raft"

	"github.com/allot/allot/allocator/state"
)

// applyUpstream applies an upstream entry of the regional ledger. One that
// does not decode, or is of a version this binary does not know, panics,
// as an undecodable Command does.
func (f *fsm) applyUpstream(l *raft.Log) any {
	res, err := f.st.ApplyUpstream(l.Data)
	if err != nil {
		hint := ""
		if errors.Is(err, state.ErrUnknownCommand) {
			hint = "; upgrade this node"
		}
		panic(fmt.Sprintf("allocator: raft log entry %d (term %d): %v%s", l.Index, l.Term, err, hint))
	}
	return res
}
