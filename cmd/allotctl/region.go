package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// printUpstream prints a regional cluster's global upstream: its
// addresses, the connection state and the global keys the region holds.
func (a *app) printUpstream(r *allotv1.ClusterStatusResponse) error {
	if r.GetRegion() == "" {
		return nil
	}
	u := r.GetUpstream()
	fmt.Fprintln(a.stdout)
	k := newKV(a.stdout, 17)
	k.add("Region", r.GetRegion())
	addrs := strings.Join(u.GetAddrs(), ",")
	if addrs == "" {
		addrs = "none (no -global-allocators: global keys get their fallback share)"
	}
	k.add("Global upstream", addrs)
	state := orDash(u.GetState())
	if u.GetSinceUnixMs() > 0 {
		state += " for " + time.Since(time.UnixMilli(u.GetSinceUnixMs())).Round(time.Second).String()
	}
	k.add("Connection", state)
	k.add("Agent id", orDash(u.GetAgentId()))
	if u.GetError() != "" {
		k.add("Last error", cell(u.GetError()))
	}
	if err := k.flush(); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "Global keys held (%d):\n", len(u.GetKeys()))
	if len(u.GetKeys()) == 0 {
		_, err := fmt.Fprintln(a.stdout, "  none")
		return err
	}
	t := newTable(&indent{w: a.stdout, prefix: "  "}, "KEY", "AVAILABLE", "DEMAND/S", "SHARE/S", "FALLBACK/S", "RECEIVED", "RETURNED", "MINTED", "DEBT", "STATE")
	for _, h := range u.GetKeys() {
		t.row(h.GetKey(), strconv.FormatInt(h.GetAvailable(), 10), fmtRate(h.GetDemand()), fmtRate(h.GetShare()),
			fmtRate(h.GetFallbackRate()), strconv.FormatInt(h.GetReceived(), 10), strconv.FormatInt(h.GetReturned(), 10),
			strconv.FormatInt(h.GetMinted(), 10), strconv.FormatInt(h.GetDebt(), 10), heldState(h))
	}
	if err := t.flush(); err != nil {
		return err
	}
	return a.printMismatches(u.GetKeys())
}

func heldState(h *allotv1.GlobalKeyHeld) string {
	s := "leasing"
	if h.GetCutOff() {
		s = "cut off: fallback share"
	}
	if h.GetRuleMismatch() {
		s += "; RULE MISMATCH"
	}
	return s
}

// printMismatches lists the global keys whose rule in the region differs
// from the global cluster's, with both limits and what is in force.
func (a *app) printMismatches(keys []*allotv1.GlobalKeyHeld) error {
	var bad []*allotv1.GlobalKeyHeld
	for _, h := range keys {
		if h.GetRuleMismatch() {
			bad = append(bad, h)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	fmt.Fprintf(a.stdout, "Rule mismatches (%d):\n", len(bad))
	t := newTable(&indent{w: a.stdout, prefix: "  "}, "KEY", "REGION'S COPY", "GLOBAL CLUSTER'S", "GLOBAL RULES VERSION", "IN FORCE")
	for _, h := range bad {
		global, version := fmtLimitShort(h.GetLimit()), strconv.FormatUint(h.GetGlobalRulesVersion(), 10)
		if st := h.GetGlobalStatus(); st != "" {
			global, version = "not leased ("+strings.TrimPrefix(st, "KEY_STATUS_")+")", "-"
		}
		t.row(h.GetKey(), fmtLimitShort(h.GetRegionLimit()), global, version, inForce(h))
	}
	if err := t.flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(a.stdout, "  The global cluster's limit sizes what this region receives, what it sub-grants to its\n"+
		"  gateways and its fallback share, whichever copy is tighter. The region's copy still sizes\n"+
		"  the fallback buckets and RateLimit-Policy headers of gateways that were given it.")
	return err
}

// inForce says which limit bounds a global key in the region.
func inForce(h *allotv1.GlobalKeyHeld) string {
	switch {
	case h.GetGlobalStatus() != "":
		return "none: the region receives nothing for it"
	case h.GetLimit() != nil:
		return "the global cluster's limit"
	default:
		return "region's copy (no answer from the global cluster yet)"
	}
}

// printLevels prints both levels of a global key inspected on a region:
// what the region holds (its gateways' leases are above), then the global
// cluster's bucket and each region's lease.
func (a *app) printLevels(r *allotv1.InspectKeyResponse) error {
	p := r.GetPool()
	if p == nil {
		return nil
	}
	fmt.Fprintln(a.stdout)
	k := newKV(a.stdout, 10)
	k.add("Region", fmt.Sprintf("holds %d tokens, demand %s/s, share %s/s, falls to %s/s; received %d, returned %d, minted %d, debt %d; %s",
		p.GetAvailable(), fmtRate(p.GetDemand()), fmtRate(p.GetShare()), fmtRate(p.GetFallbackRate()),
		p.GetReceived(), p.GetReturned(), p.GetMinted(), p.GetDebt(), heldState(p)))
	if p.GetRuleMismatch() {
		k.add("Mismatch", fmt.Sprintf("region's copy %s, global cluster's %s; in force: %s",
			fmtLimitShort(p.GetRegionLimit()), globalLimitText(p), inForce(p)))
	}
	if err := k.flush(); err != nil {
		return err
	}
	if r.GetGlobal() == nil {
		_, err := fmt.Fprintf(a.stdout, "Global cluster: not answered (%s)\n", orDash(r.GetGlobalError()))
		return err
	}
	fmt.Fprintln(a.stdout, "Global cluster (each region's lease is its agent region:NAME):")
	return a.printInspect(r.GetGlobal())
}

// globalLimitText is the global cluster's limit of a held key, or how it
// answered a key it does not lease.
func globalLimitText(h *allotv1.GlobalKeyHeld) string {
	if st := h.GetGlobalStatus(); st != "" {
		return "not leased (" + strings.TrimPrefix(st, "KEY_STATUS_") + ")"
	}
	return fmt.Sprintf("%s (rules version %d)", fmtLimitShort(h.GetLimit()), h.GetGlobalRulesVersion())
}
