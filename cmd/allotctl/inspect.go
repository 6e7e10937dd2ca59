package main

import (
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (a *app) inspectCmd() *cobra.Command {
	var (
		domain  string
		entries []string
	)
	cmd := &cobra.Command{
		Use:   "inspect [KEY]",
		Short: "Explain one budget key: matched rule and why, global tokens, leases, rates",
		Long: `inspect explains one budget key, given either as its canonical form
(domain:k1=v1,k2=v2) or as a domain and the descriptor's entries in order
(-d is repeatable). It shows the rule that matches and why (one line per
descriptor level), the global limiter state (tokens available now and the
time until the bucket is full), every agent's lease on the key, the recent
grant and deny rates, and whether the key is promoted to Redis shards.

A key the allocator holds no state for is reported as not tracked: its
bucket is full.`,
		Example: `  allotctl inspect 'public-api:tier=free,route=/v1/search,api_key=k_1'
  allotctl inspect --domain public-api -d tier=free -d route=/v1/search -d api_key=k_1
  allotctl inspect --domain public-api -d api_key=k_live_abc123 -o yaml`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &allotv1.InspectKeyRequest{}
			switch {
			case len(args) == 1 && (domain != "" || len(entries) > 0):
				return usagef("give either KEY or --domain with -d entries, not both")
			case len(args) == 1:
				if args[0] == "" {
					return usagef("KEY must not be empty")
				}
				req.Key = args[0]
			case domain == "":
				return usagef("give a canonical KEY, or --domain with -d key=value entries")
			case len(entries) == 0:
				return usagef("--domain needs at least one -d key=value entry")
			default:
				es, err := parseEntries("-d", entries)
				if err != nil {
					return err
				}
				req.Domain, req.Entries = domain, es
			}
			return runAdmin(a, cmd.Context(), "InspectKey", allotv1.AdminClient.InspectKey, req, a.printInspect)
		},
	}
	f := cmd.Flags()
	f.StringVar(&domain, "domain", "", "the descriptor's domain (instead of KEY)")
	f.StringArrayVarP(&entries, "entry", "d", nil, "descriptor entry key=value (repeatable, order kept)")
	return cmd
}

func (a *app) printInspect(r *allotv1.InspectKeyResponse) error {
	k := newKV(a.stdout, 9)
	k.add("Key", r.GetKey())
	if r.GetMatched() {
		k.add("Rule", fmtRule(r.GetLimit()))
		k.add("Limit", fmtLimitLong(r.GetLimit()))
	} else {
		k.add("Rule", "none: no rule matches (always allowed, as in Envoy)")
	}
	if err := k.flush(); err != nil {
		return err
	}
	if len(r.GetMatchTrace()) > 0 {
		fmt.Fprintln(a.stdout, "Why:")
		for _, line := range r.GetMatchTrace() {
			fmt.Fprintf(a.stdout, "  %s\n", cell(line))
		}
	}
	k = newKV(a.stdout, 9)
	switch {
	case !r.GetMatched():
	case r.GetLimit().GetUnlimited():
		k.add("Global", "unlimited: no budget is kept")
	case !r.GetTracked():
		k.add("Global", "not tracked: no state on the allocator yet (bucket full)")
	default:
		state := fmt.Sprintf("%d tokens available", r.GetTokens())
		if r.GetTokens() <= 0 {
			state = fmt.Sprintf("EMPTY (%d tokens)", r.GetTokens())
		}
		full := "full"
		if r.GetFullInMs() > 0 {
			full = "full in " + fmtMS(r.GetFullInMs())
		}
		k.add("Global", state+", "+full)
	}
	if r.GetMatched() && !r.GetLimit().GetUnlimited() {
		k.add("Rates", fmt.Sprintf("granted %s tokens/s, denied %s req/s (recent)",
			fmtRate(r.GetGrantRate()), fmtRate(r.GetDenyRate())))
		redis := "no"
		if r.GetRedisPromoted() {
			redis = "yes, " + strconv.Itoa(int(r.GetShards())) + " shards"
		}
		k.add("Redis", redis)
	}
	if err := k.flush(); err != nil {
		return err
	}
	if !r.GetMatched() || r.GetLimit().GetUnlimited() {
		return nil
	}
	var held int64
	for _, l := range r.GetLeases() {
		held += l.GetTokens()
	}
	fmt.Fprintf(a.stdout, "Leases (%d, %d tokens held):\n", len(r.GetLeases()), held)
	if len(r.GetLeases()) == 0 {
		_, err := fmt.Fprintln(a.stdout, "  none")
		return err
	}
	t := newTable(&indent{w: a.stdout, prefix: "  "}, "AGENT", "TOKENS", "GRANTED", "EXPIRES IN", "DEMAND/S")
	for _, l := range r.GetLeases() {
		t.row(l.GetAgentId(), strconv.FormatInt(l.GetTokens(), 10), fmtAge(r.GetNowUnixMs(), l.GetGrantedUnixMs()),
			fmtMS(l.GetExpiresInMs()), fmtRate(l.GetDemand()))
	}
	return t.flush()
}
