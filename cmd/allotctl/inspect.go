package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/allot/allot/pkg/redislimit"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (a *app) inspectCmd() *cobra.Command {
	var (
		domain      string
		entries     []string
		redisAddr   string
		redisPrefix string
	)
	cmd := &cobra.Command{
		Use:   "inspect [KEY]",
		Short: "Explain one budget key: matched rule and why, global tokens, leases, rates",
		Long: `inspect explains one budget key, given either as its canonical form
(domain:k1=v1,k2=v2) or as a domain and the descriptor's entries in order
(-d is repeatable). It shows the rule that matches and why (one line per
descriptor level), the global limiter state (tokens available now and the
time until the bucket is full), every agent's lease on the key, the recent
grant and deny rates, and whether the key is decided on Redis: its rule's
backend and shards. A hot key the agents promoted to sharded sub-keys at
run time (redis: promote in the gateway config) is recorded in Redis, not in
the allocator: --redis ADDR reads that promotion marker from Redis too
(--redis-key-prefix must match the gateway's redis.key_prefix).

A key the allocator holds no state for is reported as not tracked: its
bucket is full.

A scope: global key inspected on a regional cluster shows both levels: the
region's gateways' leases and what the region holds, then the global
cluster's bucket and each region's lease on it.`,
		Example: `  allotctl inspect 'public-api:tier=free,route=/v1/search,api_key=k_1'
  allotctl inspect --domain public-api -d tier=free -d route=/v1/search -d api_key=k_1
  allotctl inspect --domain public-api -d api_key=k_live_abc123 -o yaml
  allotctl inspect 'public-api:api_key=k_hot' --redis 10.0.0.20:6379`,
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
			return runAdmin(a, cmd.Context(), "InspectKey", allotv1.AdminClient.InspectKey, req, func(r *allotv1.InspectKeyResponse) error {
				if err := a.printInspect(r); err != nil {
					return err
				}
				if err := a.printLevels(r); err != nil {
					return err
				}
				if redisAddr == "" || r.GetLimit().GetBackend() != "redis" {
					return nil
				}
				return a.printPromotion(cmd.Context(), redisAddr, redisPrefix, r.GetKey())
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&domain, "domain", "", "the descriptor's domain (instead of KEY)")
	f.StringArrayVarP(&entries, "entry", "d", nil, "descriptor entry key=value (repeatable, order kept)")
	f.StringVar(&redisAddr, "redis", "", "a Redis address: also show whether agents promoted the key to sharded sub-keys (redis backend only)")
	f.StringVar(&redisPrefix, "redis-key-prefix", redislimit.DefaultConfig().KeyPrefix, "the gateway's redis.key_prefix")
	return cmd
}

func (a *app) printInspect(r *allotv1.InspectKeyResponse) error {
	k := newKV(a.stdout, 9)
	k.add("Key", r.GetKey())
	if g := r.GetGroup(); g != 0 {
		k.add("Slot", fmt.Sprintf("%d (group %d)", r.GetSlot(), g))
	} else {
		k.add("Slot", strconv.FormatUint(uint64(r.GetSlot()), 10))
	}
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
	if r.GetMatched() && r.GetStatic() != "" {
		k.add("Static", staticLine(r))
	}
	switch {
	case !r.GetMatched():
	case r.GetLimit().GetUnlimited():
		k.add("Global", "unlimited: no budget is kept")
	case !r.GetTracked() && r.GetStatic() == "static":
		k.add("Global", "not tracked: the slot holders decide it from their static shares")
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
		switch {
		case r.GetRedisPromoted() && r.GetShards() > 1:
			redis = "yes, " + strconv.Itoa(int(r.GetShards())) + " sharded sub-keys (rule)"
		case r.GetRedisPromoted():
			redis = "yes, unsharded (rule); run-time promotion: see --redis"
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

// printPromotion reads key's promotion marker from Redis at addr and prints
// whether agents promoted it to sharded sub-keys.
func (a *app) printPromotion(parent context.Context, addr, prefix, key string) error {
	cfg := redislimit.DefaultConfig()
	cfg.Addrs, cfg.KeyPrefix, cfg.Timeout = []string{addr}, prefix, a.timeout
	b, err := redislimit.New(cfg)
	if err != nil {
		return fmt.Errorf("--redis: %w", err)
	}
	defer b.Close()
	ctx, cancel := a.rpcCtx(parent)
	defer cancel()
	n, until, ok, err := b.Promotion(ctx, key, time.Now().UnixNano())
	if err != nil {
		return fmt.Errorf("cannot read the promotion from Redis at %s: %w", addr, err)
	}
	line := "not promoted (checks use the key itself)"
	if ok {
		line = fmt.Sprintf("promoted to %d sub-keys until %s", n, until.UTC().Format(time.RFC3339))
	}
	_, err = fmt.Fprintf(a.stdout, "Redis promotion: %s\n", line)
	return err
}

// staticLine says how static shares (docs/static-shares.md) treat the key.
func staticLine(r *allotv1.InspectKeyResponse) string {
	n := r.GetStaticSlots()
	switch r.GetStatic() {
	case "static":
		return fmt.Sprintf("static: each slot holder decides it from its share (1/%d of the limit), without the allocator", n)
	case "hot":
		return "hot: leased (the allocator coordinates it)"
	case "transition":
		return fmt.Sprintf("hot, in transition: its bucket holds %d of the %d shares until the other holders acknowledge or their answers lapse", r.GetStaticShares(), n)
	case "not_eligible":
		return "not eligible: leased (the rule's share is not static-eligible)"
	}
	return r.GetStatic()
}
