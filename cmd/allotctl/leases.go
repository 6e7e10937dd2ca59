package main

import (
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// maxPageSize is the server's largest ListLeases page.
const maxPageSize = allotv1.MaxPageSize

func (a *app) leasesCmd() *cobra.Command {
	var (
		req   allotv1.ListLeasesRequest
		limit int
	)
	cmd := &cobra.Command{
		Use:   "leases",
		Short: "List leases: which agent holds how many tokens of which key",
		Long: `leases lists the live leases, optionally filtered by canonical budget key,
agent id or domain, following the server's pages until --limit leases are
shown (0 = all). GRANTED is the age of the latest grant and EXPIRES IN the
time left before the lease ends, both by the allocator's clock. DEMAND is the
agent's reported rate for the key, in tokens per second.`,
		Example: `  allotctl leases
  allotctl leases --domain public-api --limit 50
  allotctl leases --key 'public-api:tier=free,route=/v1/search,api_key=k_1'
  allotctl leases --agent gw-7-4121-ab12 -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 0 {
				return usagef("invalid --limit %d: must be ≥ 0 (0 = all)", limit)
			}
			c, err := a.admin()
			if err != nil {
				return err
			}
			ctx, cancel := a.rpcCtx(cmd.Context())
			defer cancel()
			all := &allotv1.ListLeasesResponse{}
			seen := map[string]bool{}
			for {
				q := &allotv1.ListLeasesRequest{
					Key: req.Key, AgentId: req.AgentId, Domain: req.Domain,
					PageSize: maxPageSize, PageToken: all.NextPageToken,
				}
				if limit > 0 && limit-len(all.Leases) < maxPageSize {
					q.PageSize = int32(limit - len(all.Leases))
				}
				resp, err := c.ListLeases(ctx, q)
				if err != nil {
					return a.rpcErr("ListLeases", err)
				}
				all.Leases = append(all.Leases, resp.GetLeases()...)
				all.NowUnixMs = resp.GetNowUnixMs()
				all.NextPageToken = resp.GetNextPageToken()
				if all.NextPageToken == "" || (limit > 0 && len(all.Leases) >= limit) {
					break
				}
				if seen[all.NextPageToken] {
					return fmt.Errorf("ListLeases: the allocator returned page token %q twice", all.NextPageToken)
				}
				seen[all.NextPageToken] = true
			}
			if limit > 0 && len(all.Leases) > limit {
				all.Leases = all.Leases[:limit]
			}
			if a.structured() {
				return a.writeProto(all)
			}
			if err := a.printLeases(all.GetLeases(), all.GetNowUnixMs(), true); err != nil {
				return err
			}
			if all.NextPageToken != "" {
				fmt.Fprintf(a.stderr, "(more leases not shown: raise --limit, 0 = all)\n")
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Key, "key", "", "only this canonical budget key (domain:k1=v1,k2=v2)")
	f.StringVar(&req.AgentId, "agent", "", "only leases held by this agent id")
	f.StringVar(&req.Domain, "domain", "", "only keys of this domain")
	f.IntVar(&limit, "limit", 1000, "show at most N leases (0 = all)")
	return cmd
}

// printLeases writes a lease table; withKey adds the KEY column (inspect
// omits it, the key is printed above).
func (a *app) printLeases(ls []*allotv1.Lease, nowMS int64, withKey bool) error {
	if len(ls) == 0 {
		_, err := fmt.Fprintln(a.stdout, "No leases.")
		return err
	}
	hdr := []string{"AGENT", "TOKENS", "GRANTED", "EXPIRES IN", "DEMAND/S", "RULE"}
	if withKey {
		hdr = append([]string{"KEY"}, hdr...)
	}
	t := newTable(a.stdout, hdr...)
	for _, l := range ls {
		row := []string{
			l.GetAgentId(),
			strconv.FormatInt(l.GetTokens(), 10),
			fmtAge(nowMS, l.GetGrantedUnixMs()),
			fmtMS(l.GetExpiresInMs()),
			fmtRate(l.GetDemand()),
			l.GetRule(),
		}
		if withKey {
			row = append([]string{l.GetKey()}, row...)
		}
		t.row(row...)
	}
	return t.flush()
}
