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
	return t.flush()
}

func heldState(h *allotv1.GlobalKeyHeld) string {
	s := "leasing"
	if h.GetCutOff() {
		s = "cut off: fallback share"
	}
	if h.GetRuleMismatch() {
		s += "; RULE MISMATCH (the global cluster's limit applies)"
	}
	return s
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
	k := newKV(a.stdout, 9)
	k.add("Region", fmt.Sprintf("holds %d tokens, demand %s/s, share %s/s, falls to %s/s; received %d, returned %d, minted %d, debt %d; %s",
		p.GetAvailable(), fmtRate(p.GetDemand()), fmtRate(p.GetShare()), fmtRate(p.GetFallbackRate()),
		p.GetReceived(), p.GetReturned(), p.GetMinted(), p.GetDebt(), heldState(p)))
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
