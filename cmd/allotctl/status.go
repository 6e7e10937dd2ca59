package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (a *app) statusCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Show cluster health: members, leader, Raft indexes, rules version, load",
		Long: `status asks one allocator node (--addr) for the cluster's state: the Raft
members with their roles and addresses, the leader, the answering node's term,
commit and applied index and time since it last heard from the leader, the
rules version, and the number of live agents, tracked keys and leases. In a
cluster with several Raft groups it also lists the groups: each one's
leader, voters, owned slot ranges, tracked keys and the answering node's
applied index and role in it (group 0 is the meta group, which owns no
slots). On a regional cluster (allocator -region) it also shows the global
upstream, the connection state (from the leader) and the global keys the
region holds. With static shares on (allocator -static-slots) it shows their
slots, how many agents hold one, the hot-key set's size and version, and the
transitions under way.`,
		Example: `  allotctl status
  allotctl --addr 10.0.0.6:7420 status -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runAdmin(a, cmd.Context(), "ClusterStatus", allotv1.AdminClient.ClusterStatus, &allotv1.ClusterStatusRequest{}, a.printStatus)
		},
	}
}

func (a *app) printStatus(r *allotv1.ClusterStatusResponse) error {
	k := newKV(a.stdout, 16)
	leader := r.GetLeaderId()
	if leader == "" {
		leader = "NONE (no leader known: election in progress or quorum lost)"
	}
	k.add("Leader", leader)
	k.add("Answered by", fmt.Sprintf("%s (%s)", orDash(r.GetNodeId()), orDash(r.GetState())))
	k.add("Term", strconv.FormatUint(r.GetTerm(), 10))
	k.add("Commit index", strconv.FormatUint(r.GetCommitIndex(), 10))
	k.add("Applied index", strconv.FormatUint(r.GetAppliedIndex(), 10))
	k.add("Last snapshot", strconv.FormatUint(r.GetLastSnapshotIndex(), 10))
	contact := fmtMS(r.GetLastContactMs()) + " ago"
	if r.GetNodeId() != "" && r.GetNodeId() == r.GetLeaderId() {
		contact = "- (this node leads)"
	}
	k.add("Last contact", contact)
	k.add("Rules version", strconv.FormatUint(r.GetRulesVersion(), 10))
	k.add("Agents", strconv.FormatUint(uint64(r.GetAgents()), 10))
	k.add("Keys", strconv.FormatUint(r.GetKeys(), 10))
	k.add("Leases", strconv.FormatUint(r.GetLeases(), 10))
	if st := r.GetStatic(); st != nil {
		k.add("Static shares", staticSummary(st))
	}
	if err := k.flush(); err != nil {
		return err
	}
	fmt.Fprintln(a.stdout)
	t := newTable(a.stdout, "MEMBER", "ROLE", "SUFFRAGE", "RAFT", "GRPC", "HTTP")
	for _, m := range r.GetMembers() {
		id := m.GetId()
		if id == r.GetNodeId() {
			id += "*"
		}
		t.row(id, m.GetRole(), m.GetSuffrage(), m.GetRaftAddr(), m.GetGrpcAddr(), m.GetHttpAddr())
	}
	if err := t.flush(); err != nil {
		return err
	}
	if len(r.GetMembers()) == 0 {
		fmt.Fprintln(a.stdout, "(no members reported)")
	} else {
		fmt.Fprintln(a.stdout, "(* = the node that answered)")
	}
	if len(r.GetGroups()) > 0 {
		fmt.Fprintf(a.stdout, "\nGroups (cluster %s, slot map version %d):\n", r.GetClusterId(), r.GetTopologyVersion())
		t = newTable(a.stdout, "GROUP", "LEADER", "MEMBERS", "SLOTS", "KEYS", "APPLIED", "STATE")
		for _, g := range r.GetGroups() {
			id := strconv.FormatUint(uint64(g.GetId()), 10)
			slots := orDash(g.GetSlots())
			if g.GetId() == 0 {
				id, slots = "0 (meta)", "-"
			}
			t.row(id, orDash(g.GetLeaderId()), orDash(strings.Join(g.GetMembers(), ",")), slots,
				strconv.FormatUint(g.GetKeys(), 10), strconv.FormatUint(g.GetAppliedIndex(), 10), g.GetState())
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	return a.printUpstream(r)
}

// staticSummary is status's one line on static shares.
func staticSummary(st *allotv1.StaticStatus) string {
	s := fmt.Sprintf("%d slots (%d held), TTL %s, shares refilling within %s; %d hot keys (version %d), %d in transition",
		st.GetSlots(), st.GetSlotsHeld(), fmtMS(st.GetTtlMs()), fmtMS(st.GetMaxRefillMs()),
		st.GetHotKeys(), st.GetHotVersion(), st.GetTransitions())
	if st.GetPaused() {
		next := "off"
		if st.GetNextSlots() > 0 {
			next = fmt.Sprintf("%d slots, TTL %s", st.GetNextSlots(), fmtMS(st.GetNextTtlMs()))
		}
		s += "; changing to " + next + " (no slot is given until then)"
	}
	return s
}
