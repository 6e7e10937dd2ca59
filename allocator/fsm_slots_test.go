package allocator

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/slots"
)

// TestFSMAppliesSlotEntries: a slot entry reaches the state in log order
// and its result says whether it was refused; one of an operation this
// binary does not know stops the node.
func TestFSMAppliesSlotEntries(t *testing.T) {
	f := &fsm{st: state.New(state.DefaultConfig())}
	rs := []slots.Range{{First: 10, Last: 20}}
	apply := func(i uint64, data []byte) state.SlotResult {
		t.Helper()
		res, ok := f.Apply(&raft.Log{Index: i, Term: 1, Type: raft.LogCommand, Data: data}).(state.SlotResult)
		if !ok {
			t.Fatalf("entry %d: result is not a state.SlotResult", i)
		}
		return res
	}
	if res := apply(1, state.AppendSlotEntry(nil, state.SlotFreeze, 1, rs, nil)); res.Err != nil {
		t.Fatalf("freeze: %v", res.Err)
	}
	if frozen, _ := f.st.SlotModes(); len(frozen) != 1 || frozen[0] != rs[0] {
		t.Fatalf("frozen %v, want %v", frozen, rs)
	}
	if res := apply(2, state.AppendSlotEntry(nil, state.SlotDisown, 2, rs, nil)); !errors.Is(res.Err, state.ErrSlotRefused) {
		t.Fatalf("disown of frozen slots: %v, want refused", res.Err)
	}
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "entry 3") {
			t.Errorf("unknown slot op: recovered %v, want a panic naming entry 3", r)
		}
	}()
	f.Apply(&raft.Log{Index: 3, Term: 1, Type: raft.LogCommand, Data: state.AppendSlotEntry(nil, 99, 3, rs, nil)})
}
