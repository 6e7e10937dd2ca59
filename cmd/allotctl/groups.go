package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// moveTimeout is the default --timeout of the commands that wait for slot
// moves to end.
const moveTimeout = 2 * time.Minute

// longerTimeout raises --timeout to moveTimeout unless it was given.
func (a *app) longerTimeout(cmd *cobra.Command) {
	if f := cmd.Flag("timeout"); f == nil || !f.Changed {
		a.timeout = moveTimeout
	}
}

func (a *app) slotsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "slots",
		Short: "Move slots between the data groups of a cluster with several groups",
		Long: `slots moves slot ranges between the data groups of a cluster started with
-groups N. Every budget key belongs to one of 1024 slots; allotctl status
shows each group's slot ranges.`,
		Example: `  allotctl slots move --slots 0-63 --to 2`,
		RunE:    groupRunE,
	}
	cmd.AddCommand(a.slotsMoveCmd())
	return cmd
}

func (a *app) slotsMoveCmd() *cobra.Command {
	var rng string
	var to uint32
	cmd := &cobra.Command{
		Use:   "move --slots A-B --to G",
		Short: "Move slots A-B to data group G while the cluster serves",
		Long: `move moves the slots A-B (all owned by one group) to data group G and waits
until the move has ended. The source group freezes the slots, the target
group takes their keys' bucket state and leases exactly, then the meta
group records the new owner; meanwhile agents decide the moving keys from
their leases and fallback buckets. A move to a group that does not exist,
or of slots already moving, is refused. --timeout (default 2m here) bounds
the wait; a move still in flight then goes on.`,
		Example: `  allotctl slots move --slots 0-63 --to 2
  allotctl slots move --slots 700 --to 1 -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if _, err := slots.ParseRange(rng); err != nil {
				return usagef("invalid --slots %q: %v", rng, err)
			}
			if to == 0 {
				return usagef("--to must name a data group (1 or more); group 0 is the meta group")
			}
			a.longerTimeout(cmd)
			req := &allotv1.MoveSlotsRequest{Slots: rng, To: to}
			var moves []*allotv1.SlotMove
			call := func(c allotv1.AdminClient, ctx context.Context, r *allotv1.MoveSlotsRequest, opts ...grpc.CallOption) (*allotv1.MoveSlotsResponse, error) {
				resp, err := c.MoveSlots(ctx, r, opts...)
				moves = append(moves, resp.GetMove())
				return resp, err
			}
			err := runAdmin(a, cmd.Context(), "MoveSlots", call, req, func(resp *allotv1.MoveSlotsResponse) error {
				return a.printMove(resp.GetMove())
			})
			return abortedErr(err, moves)
		},
	}
	cmd.Flags().StringVar(&rng, "slots", "", "the slots to move: A-B or A (0-1023)")
	cmd.Flags().Uint32Var(&to, "to", 0, "the data group that owns the slots afterwards")
	_ = cmd.MarkFlagRequired("slots")
	_ = cmd.MarkFlagRequired("to")
	return cmd
}

func (a *app) groupsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "groups",
		Short: "Add a data group, even out the slots over the data groups",
		Long:  `groups works on the data groups of a cluster started with -groups N.`,
		Example: `  allotctl groups add
  allotctl groups rebalance`,
		RunE: groupRunE,
	}
	cmd.AddCommand(a.groupsAddCmd(), a.groupsRebalanceCmd())
	return cmd
}

func (a *app) groupsAddCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "add",
		Short: "Add a data group to the running cluster",
		Long: `add adds a data group with every voter as a member and waits until it has a
leader. The new group owns no slots: groups rebalance (or slots move) gives
it some.`,
		Example: `  allotctl groups add && allotctl groups rebalance`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			a.longerTimeout(cmd)
			return runAdmin(a, cmd.Context(), "AddGroup", allotv1.AdminClient.AddGroup, &allotv1.AddGroupRequest{}, func(resp *allotv1.AddGroupResponse) error {
				_, err := fmt.Fprintf(a.stdout, "Added group %d (members %s; leader %s). It owns no slots yet: run allotctl groups rebalance.\n",
					resp.GetId(), strings.Join(resp.GetMembers(), ", "), orDash(resp.GetLeaderId()))
				return err
			})
		},
	}
}

func (a *app) groupsRebalanceCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rebalance",
		Short: "Move slots until every data group owns about as many",
		Long: `rebalance plans the fewest slot moves that leave every data group with
⌊1024/G⌋ or ⌈1024/G⌉ slots, runs them one at a time (as slots move does)
and lists them. It is refused while a move is in flight. --timeout (default
2m here) bounds the whole run.`,
		Example: `  allotctl groups rebalance`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			a.longerTimeout(cmd)
			var moves []*allotv1.SlotMove
			call := func(c allotv1.AdminClient, ctx context.Context, r *allotv1.RebalanceSlotsRequest, opts ...grpc.CallOption) (*allotv1.RebalanceSlotsResponse, error) {
				resp, err := c.RebalanceSlots(ctx, r, opts...)
				moves = resp.GetMoves()
				return resp, err
			}
			err := runAdmin(a, cmd.Context(), "RebalanceSlots", call, &allotv1.RebalanceSlotsRequest{}, func(resp *allotv1.RebalanceSlotsResponse) error {
				if len(resp.GetMoves()) == 0 {
					_, err := fmt.Fprintln(a.stdout, "The slots are even already.")
					return err
				}
				for _, m := range resp.GetMoves() {
					if err := a.printMove(m); err != nil {
						return err
					}
				}
				return nil
			})
			return abortedErr(err, moves)
		},
	}
}

// abortedErr turns a successful call whose moves include an aborted one
// into exit code 1, naming the first aborted move on stderr, so that a
// script running a move or a rebalance sees that it did not finish.
func abortedErr(err error, moves []*allotv1.SlotMove) error {
	if err != nil {
		return err
	}
	for _, m := range moves {
		if m != nil && !m.GetCommitted() {
			return &codeError{code: exitError, err: fmt.Errorf("move %d of slots %s aborted: %s", m.GetId(), m.GetSlots(), m.GetReason())}
		}
	}
	return nil
}

// printMove prints one ended move.
func (a *app) printMove(m *allotv1.SlotMove) error {
	took := time.Duration(m.GetEndedUnixMs()-m.GetStartedUnixMs()) * time.Millisecond
	if !m.GetCommitted() {
		_, err := fmt.Fprintf(a.stdout, "Move %d of slots %s from group %d to group %d aborted after %s: %s\n",
			m.GetId(), m.GetSlots(), m.GetFrom(), m.GetTo(), took, m.GetReason())
		return err
	}
	_, err := fmt.Fprintf(a.stdout, "Moved slots %s from group %d to group %d in %s (slot map version %d).\n",
		m.GetSlots(), m.GetFrom(), m.GetTo(), took, m.GetSlotMapVersion())
	return err
}
