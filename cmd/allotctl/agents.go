package main

import (
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (a *app) agentsCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "agents",
		Short: "List the agents the allocator knows: last contact, keys and tokens held",
		Long: `agents lists every agent the allocator has heard from within the agent TTL:
when it last called (by the allocator's clock), how many keys it holds leases
on and how many tokens in total, how many keys it currently decides from its
local fallback buckets (no lease yet, or the allocator was unreachable), and
its last request id. With static shares on, a column says which agents hold a
slot and the hot-key set version each acknowledged.`,
		Example: `  allotctl agents
  allotctl agents -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runAdmin(a, cmd.Context(), "ListAgents", allotv1.AdminClient.ListAgents, &allotv1.ListAgentsRequest{}, a.printAgents)
		},
	}
}

func (a *app) printAgents(r *allotv1.ListAgentsResponse) error {
	if len(r.GetAgents()) == 0 {
		_, err := fmt.Fprintln(a.stdout, "No agents.")
		return err
	}
	slots := false // static shares: a column when an agent holds a slot
	for _, ag := range r.GetAgents() {
		slots = slots || ag.GetStaticSlot()
	}
	head := []string{"AGENT", "LAST CONTACT", "KEYS", "TOKENS", "FALLBACK KEYS", "LAST REQUEST"}
	if slots {
		head = append(head, "STATIC SLOT")
	}
	t := newTable(a.stdout, head...)
	for _, ag := range r.GetAgents() {
		row := []string{ag.GetAgentId(), fmtAge(r.GetNowUnixMs(), ag.GetLastContactUnixMs()),
			strconv.FormatUint(uint64(ag.GetKeysHeld()), 10), strconv.FormatInt(ag.GetTokensHeld(), 10),
			strconv.FormatUint(uint64(ag.GetFallbackKeys()), 10), strconv.FormatUint(ag.GetLastRequestId(), 10)}
		if slots {
			slot := "-"
			if ag.GetStaticSlot() {
				slot = "yes, acknowledged hot-key set version " + strconv.FormatUint(ag.GetHotVersionAcked(), 10)
			}
			row = append(row, slot)
		}
		t.row(row...)
	}
	return t.flush()
}
