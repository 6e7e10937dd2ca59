package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/cespare/xxhash/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// maxWatchBackoff caps the rule watch's reconnect backoff.
const maxWatchBackoff = 5 * time.Second

// staleRulesGrace is how long Acquire answers may carry a newer committed
// rules version than the watch delivered before the watch is re-established:
// a healthy stream delivers a new version within milliseconds of its
// commit, so a version still missing after this is a stream attached to a
// node that no longer receives the log (removed, or in a minority).
const staleRulesGrace = 2 * time.Second

// watchRules keeps a WatchRules stream open, rotating over the allocators
// and reconnecting with jittered exponential backoff, until Close. While no
// stream is up the last rules keep serving.
func (a *Agent) watchRules() {
	backoff := a.cfg.ProbeBackoff
	idx := 0
	for a.ctx.Err() == nil {
		if a.watchOnce(idx) {
			backoff = a.cfg.ProbeBackoff
		} else {
			backoff = min(2*backoff, maxWatchBackoff)
		}
		idx = (idx + 1) % len(a.clients)
		t := time.NewTimer(a.jitter(backoff))
		select {
		case <-a.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// watchOnce runs one stream to its end and reports whether it delivered at
// least one rule set.
func (a *Agent) watchOnce(idx int) bool {
	var known uint64
	if s := a.rules.Load(); s != nil && a.rulesFromAllocator.Load() {
		known = s.Version()
	}
	ctx, cancel := context.WithCancel(a.ctx)
	defer cancel()
	a.watchCancel.Store(&cancel)
	defer a.watchCancel.Store(nil)
	stream, err := a.clients[idx].WatchRules(ctx, &allotv1.WatchRulesRequest{AgentId: a.cfg.ID, KnownVersion: known})
	if err != nil {
		a.logWatchEnd(idx, err)
		return false
	}
	got := false
	for {
		rs, err := stream.Recv()
		if err != nil {
			a.logWatchEnd(idx, err)
			return got
		}
		got = true
		a.talked.Store(true)
		_ = a.applyRuleSet(rs) // a rejected set is logged and counted
	}
}

// noteRulesVersion takes the committed rules version an Acquire answer
// carried (at now, agent clock). When it stays newer than the current rule
// set's for staleRulesGrace, the rule watch is re-established (on the next
// allocator), counted and logged.
func (a *Agent) noteRulesVersion(committed uint64, now int64) {
	cur := a.rules.Load()
	if committed == 0 || !a.rulesFromAllocator.Load() || cur == nil || committed <= cur.Version() {
		a.staleSince.Store(0)
		return
	}
	since := a.staleSince.Load()
	if since == 0 {
		a.staleSince.CompareAndSwap(0, now)
		return
	}
	if now-since < int64(staleRulesGrace) {
		return
	}
	a.staleSince.Store(0)
	a.met.rulesStale.Inc()
	a.log.Warn("agent: rules are stale; re-establishing the rule watch",
		"have", cur.Version(), "committed", committed, "for", time.Duration(now-since))
	if c := a.watchCancel.Load(); c != nil {
		(*c)()
	}
}

func (a *Agent) logWatchEnd(idx int, err error) {
	if a.ctx.Err() != nil || errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
		return
	}
	a.logs.log(a.log, "watch_rules", "agent: rule watch interrupted; serving the last rules",
		"allocator", a.names[idx], "err", err)
}

// applyRuleSet takes a streamed rule set's topology, if any, then compiles
// the rule set and swaps it in. Only newer
// versions replace allocator-delivered rules (a reconnect to a lagging node
// must not roll back); a set that fails to compile keeps the old rules and
// is returned as an error.
func (a *Agent) applyRuleSet(rs *allotv1.RuleSet) error {
	a.noteTopology(rs.GetTopology()) // groups.go
	cur := a.rules.Load()
	if cur != nil && a.rulesFromAllocator.Load() && rs.GetVersion() <= cur.Version() {
		return nil
	}
	files := make([]rules.File, len(rs.GetFiles()))
	for i, f := range rs.GetFiles() {
		files[i] = rules.File{Name: f.GetName(), Domain: f.GetDomain(), Source: f.GetYaml()}
	}
	set, err := rules.Compile(rs.GetVersion(), files)
	if err != nil {
		a.met.reloadsFailed.Inc()
		a.logs.logLevel(a.log, slog.LevelError, "rules_compile", "agent: streamed rule set rejected; keeping the old rules",
			"version", rs.GetVersion(), "err", err)
		return fmt.Errorf("agent: rule set version %d rejected: %w", rs.GetVersion(), err)
	}
	a.setRules(set, true)
	a.met.reloadsOK.Inc()
	a.log.Info("agent: rules updated", "version", set.Version(), "domains", len(set.Domains()))
	return nil
}

// fileWatch is the standalone rules files' state, owned by the file watch
// goroutine (and by New before it starts).
type fileWatch struct {
	base    []rules.File // Config.Rules' files, compiled with the files
	version uint64
	stats   []fileStat
	sum     uint64 // content hash of the last compiled (or rejected) input
}

type fileStat struct {
	mod  time.Time
	size int64
}

func (w *fileWatch) init(base *rules.Set) {
	if base != nil {
		w.base = base.Files()
		w.version = base.Version()
	}
}

// load reads and compiles the files if they changed. It returns a nil set
// when nothing changed. With initial, any failure is an error for New.
func (w *fileWatch) load(paths []string, initial bool) (*rules.Set, error) {
	stats := make([]fileStat, len(paths))
	changed := initial || len(w.stats) != len(paths)
	for i, p := range paths {
		fi, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("agent: rules file: %w", err)
		}
		stats[i] = fileStat{fi.ModTime(), fi.Size()}
		if !changed && stats[i] != w.stats[i] {
			changed = true
		}
	}
	if !changed {
		return nil, nil
	}
	files := append([]rules.File(nil), w.base...)
	h := xxhash.New()
	for _, p := range paths {
		src, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("agent: rules file: %w", err)
		}
		_, _ = h.WriteString(p)
		_, _ = h.Write(src)
		files = append(files, rules.File{Name: p, Source: src})
	}
	w.stats = stats
	sum := h.Sum64()
	if !initial && sum == w.sum {
		return nil, nil // touched, not changed
	}
	w.sum = sum
	set, err := rules.Compile(w.version+1, files)
	if err != nil {
		return nil, fmt.Errorf("agent: rules files rejected: %w", err)
	}
	w.version++
	return set, nil
}

// watchFiles polls the standalone rules files until Close. A file that fails
// to load or compile keeps the old rules (logged, counted); fixing it is
// picked up by the next poll.
func (a *Agent) watchFiles() {
	t := time.NewTicker(a.cfg.RulesPollInterval)
	defer t.Stop()
	for {
		select {
		case <-a.stop:
			return
		case <-t.C:
			a.reloadFiles()
		}
	}
}

func (a *Agent) reloadFiles() {
	set, err := a.fw.load(a.cfg.RulesFiles, false)
	switch {
	case err != nil:
		a.met.reloadsFailed.Inc()
		a.logs.logLevel(a.log, slog.LevelError, "rules_files", "agent: keeping the old rules", "err", err)
	case set != nil:
		a.setRules(set, false)
		a.met.reloadsOK.Inc()
		a.log.Info("agent: rules files reloaded", "version", set.Version(), "domains", len(set.Domains()))
	}
}
