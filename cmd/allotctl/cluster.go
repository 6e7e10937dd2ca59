package main

import (
	"fmt"

	"github.com/spf13/cobra"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (a *app) clusterCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "Change the Raft membership: join, remove, transfer leadership",
		Long: `cluster changes the allocator cluster's Raft membership through any node
(--addr); the request is forwarded to the leader.`,
		Example: `  allotctl cluster join 10.0.0.9:7420 --id alloc-4 --raft-addr 10.0.0.9:7421
  allotctl cluster remove alloc-4
  allotctl cluster transfer-leader`,
		RunE: groupRunE,
	}
	cmd.AddCommand(a.clusterJoinCmd(), a.clusterRemoveCmd(), a.clusterTransferCmd())
	return cmd
}

func (a *app) clusterJoinCmd() *cobra.Command {
	req := &allotv1.AddVoterRequest{}
	cmd := &cobra.Command{
		Use:   "join ADDR --id ID --raft-addr RAFT_ADDR [--http-addr HTTP_ADDR]",
		Short: "Add a node as a voter (ADDR is the new node's gRPC address)",
		Long: `join adds a running allocator node to the cluster as a voter. ADDR is the
new node's gRPC address, --raft-addr its Raft address and --id its node id;
--addr names any current member. Nodes started with -join do this
themselves; use this command for nodes started without it.`,
		Example: `  allotctl cluster join 10.0.0.9:7420 --id alloc-4 --raft-addr 10.0.0.9:7421 --http-addr 10.0.0.9:7422`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.GrpcAddr = args[0]
			return runAdmin(a, cmd.Context(), "AddVoter", allotv1.AdminClient.AddVoter, req, func(resp *allotv1.AddVoterResponse) error {
				_, err := fmt.Fprintf(a.stdout, "Added voter %s (raft %s, grpc %s).\n", req.Id, req.RaftAddr, req.GrpcAddr)
				return err
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Id, "id", "", "the new node's id (required)")
	f.StringVar(&req.RaftAddr, "raft-addr", "", "the new node's Raft address host:port (required)")
	f.StringVar(&req.HttpAddr, "http-addr", "", "the new node's HTTP address host:port")
	_ = cmd.MarkFlagRequired("id")
	_ = cmd.MarkFlagRequired("raft-addr")
	return cmd
}

func (a *app) clusterRemoveCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "remove ID",
		Short: "Remove a node from the cluster",
		Long: `remove takes a node out of the Raft configuration. Removing the leader makes
it step down after the change commits. Keep a majority of the remaining
voters up.`,
		Example: `  allotctl cluster remove alloc-4`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runAdmin(a, cmd.Context(), "RemoveServer", allotv1.AdminClient.RemoveServer, &allotv1.RemoveServerRequest{Id: args[0]}, func(resp *allotv1.RemoveServerResponse) error {
				_, err := fmt.Fprintf(a.stdout, "Removed %s.\n", args[0])
				return err
			})
		},
	}
}

func (a *app) clusterTransferCmd() *cobra.Command {
	var group uint32
	cmd := &cobra.Command{
		Use:   "transfer-leader [ID]",
		Short: "Hand leadership to another voter (ID, or any suitable one)",
		Long: `transfer-leader asks the leader to hand leadership to the voter ID, or to
any up-to-date voter when ID is omitted, for example before restarting the
leader's machine. In a cluster with several Raft groups, --group names the
group (0, the default, is the meta group); the meta group's leader keeps
the data groups' leaders spread over the nodes, so it may move a data
group's leadership again.`,
		Example: `  allotctl cluster transfer-leader
  allotctl cluster transfer-leader alloc-2
  allotctl cluster transfer-leader --group 3 alloc-2`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &allotv1.TransferLeadershipRequest{Group: group}
			if len(args) == 1 {
				req.Id = args[0]
			}
			return runAdmin(a, cmd.Context(), "TransferLeadership", allotv1.AdminClient.TransferLeadership, req, func(resp *allotv1.TransferLeadershipResponse) error {
				_, err := fmt.Fprintf(a.stdout, "Leader is now %s.\n", orDash(resp.GetLeaderId()))
				return err
			})
		},
	}
	cmd.Flags().Uint32Var(&group, "group", 0, "the Raft group whose leadership moves (a cluster with several groups; 0: the meta group)")
	return cmd
}
