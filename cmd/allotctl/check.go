package main

import (
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (a *app) checkCmd() *cobra.Command {
	var (
		domain  string
		entries []string
		descs   []string
		hits    uint32
	)
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Run one authoritative check-and-take against the global budget",
		Long: `check runs one check-and-take against the allocator's global budget,
committed through Raft, and shows the outcome per descriptor: the code, the
rule, the tokens remaining, the time until the bucket is full (RESET) and,
when over the limit, until enough tokens are back (RETRY AFTER). SHADOW marks
a rule in shadow mode that would have denied.

It takes --hits tokens (default 1) from the real budget, as a request
would. Give one descriptor with repeated -d key=value (order kept), or
several with repeated -D 'k1=v1,k2=v2' (write a literal comma in a value as
\,). The exit code is 0 for OK and OVER_LIMIT alike.`,
		Example: `  allotctl check --domain public-api -d tier=free -d route=/v1/search -d api_key=k_1
  allotctl check --domain public-api --hits 5 \
      -D tier=free,api_key=k_1 -D tier=free,route=/v1/search,api_key=k_1 -D api_key=k_1`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if domain == "" {
				return usagef("--domain is required")
			}
			if hits == 0 {
				return usagef("--hits must be ≥ 1 (the check always takes tokens)")
			}
			req := &allotv1.CheckRequest{Domain: domain, Hits: hits}
			if len(entries) > 0 {
				es, err := parseEntries("-d", entries)
				if err != nil {
					return err
				}
				req.Descriptors = append(req.Descriptors, &allotv1.Descriptor{Entries: es})
			}
			for _, s := range descs {
				d, err := parseDescriptor("-D", s)
				if err != nil {
					return err
				}
				req.Descriptors = append(req.Descriptors, d)
			}
			if len(req.Descriptors) == 0 {
				return usagef("give a descriptor with -d key=value (repeatable) or -D k1=v1,k2=v2")
			}
			return runAdmin(a, cmd.Context(), "Check", allotv1.AdminClient.Check, req, func(resp *allotv1.CheckResponse) error { return a.printCheck(req, resp) })
		},
	}
	f := cmd.Flags()
	f.StringVar(&domain, "domain", "", "the request's domain (required)")
	f.StringArrayVarP(&entries, "entry", "d", nil, "entry key=value of one descriptor (repeatable, order kept)")
	f.StringArrayVarP(&descs, "descriptor", "D", nil, "a whole descriptor k1=v1,k2=v2 (repeatable)")
	f.Uint32Var(&hits, "hits", 1, "tokens to take from the budget")
	return cmd
}

func (a *app) printCheck(req *allotv1.CheckRequest, r *allotv1.CheckResponse) error {
	fmt.Fprintf(a.stdout, "Overall: %s\n\n", fmtCode(r.GetOverallCode()))
	t := newTable(a.stdout, "#", "CODE", "DESCRIPTOR", "RULE", "LIMIT", "REMAINING", "RESET", "RETRY AFTER", "SHADOW")
	for i, s := range r.GetStatuses() {
		desc := s.GetKey()
		if desc == "" && i < len(req.GetDescriptors()) {
			desc = fmtEntries(req.GetDescriptors()[i].GetEntries())
		}
		rule, limit, remaining, reset, retry := "none (unlimited)", "-", "-", "-", "-"
		if s.GetMatched() {
			rule = fmtRule(s.GetLimit())
			limit = fmtLimitShort(s.GetLimit())
			if !s.GetLimit().GetUnlimited() {
				remaining = strconv.FormatInt(s.GetRemaining(), 10)
				reset = fmtMS(s.GetResetAfterMs())
				if s.GetRetryAfterMs() > 0 {
					retry = fmtMS(s.GetRetryAfterMs())
				}
			}
		}
		t.row(strconv.Itoa(i+1), fmtCode(s.GetCode()), desc, rule, limit, remaining, reset, retry, yesNo(s.GetShadow()))
	}
	return t.flush()
}
