package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// release runs at Close, after the refill loop has stopped: it delivers the
// unacknowledged batch, if any, then hands back every live lease balance and
// reports every owed charge in Release calls (the last one with all=true, so
// the allocator ends every lease of this agent).
func (a *Agent) release(ctx context.Context) error {
	rf := &a.rf
	if rf.unacked != nil {
		if !a.sendWithin(ctx, func(ctx context.Context) bool { return a.send(ctx, rf.unacked) }) {
			return errors.New("agent: close: the allocator did not acknowledge the last Acquire; its charges are lost")
		}
	}
	now := a.loopNow()
	var keys []*allotv1.KeyAcquire
	for i := range a.keys.shards {
		for _, ks := range a.keys.shards[i].snapshot(nil) {
			if ks.local.Load() {
				continue
			}
			var returned int64
			if now < ks.expiry.Load() {
				returned = ks.balance.Swap(0)
			}
			charged := max(ks.charged.Swap(0), 0)
			outage := max(ks.outage.Swap(0), 0)
			if returned == 0 && charged == 0 && outage == 0 {
				continue
			}
			keys = append(keys, &allotv1.KeyAcquire{
				Domain:        ks.domain,
				Entries:       toProtoEntries(ks.entries),
				Returned:      returned,
				Charged:       charged,
				OutageCharged: outage,
			})
		}
	}
	if a.cfg.driven {
		// Deterministic batches (see refillOnce).
		slices.SortFunc(keys, func(x, y *allotv1.KeyAcquire) int {
			if c := strings.Compare(x.Domain, y.Domain); c != 0 {
				return c
			}
			return slices.CompareFunc(x.Entries, y.Entries, func(p, q *allotv1.Entry) int {
				if c := strings.Compare(p.Key, q.Key); c != 0 {
					return c
				}
				return strings.Compare(p.Value, q.Value)
			})
		})
	}
	for {
		n := min(len(keys), maxBatchKeys)
		req := &allotv1.ReleaseRequest{
			AgentId:   a.cfg.ID,
			RequestId: rf.core.NextID(),
			Keys:      keys[:n],
			All:       n == len(keys),
		}
		var lastErr error
		ok := a.sendWithin(ctx, func(ctx context.Context) bool {
			cctx, cancel := context.WithTimeout(ctx, a.cfg.CallTimeout)
			defer cancel()
			_, err := a.callRelease(cctx, req)
			if err != nil {
				lastErr = err
				if retryable(err) {
					rf.addr = (rf.addr + 1) % len(a.clients)
					return false
				}
			}
			return true
		})
		if !ok && lastErr == nil {
			lastErr = ctx.Err()
		}
		if !ok || lastErr != nil && !retryable(lastErr) {
			return fmt.Errorf("agent: close: release: %w", lastErr)
		}
		keys = keys[n:]
		if len(keys) == 0 {
			return nil
		}
	}
}

// sendWithin retries f (with the same request) while ctx allows, at most
// once per allocator plus one, and reports whether it succeeded.
func (a *Agent) sendWithin(ctx context.Context, f func(context.Context) bool) bool {
	for range len(a.clients) + 1 {
		if ctx.Err() != nil {
			return false
		}
		if f(ctx) {
			return true
		}
	}
	return false
}
