package agent

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// logEvery is the least time between two log lines of one kind.
const logEvery = 5 * time.Second

// logLimiter rate-limits log lines per kind: at most one line per kind every
// logEvery, carrying the number of lines suppressed since the previous one.
// It reads the wall clock: logging is never on a decision path that must be
// deterministic.
type logLimiter struct {
	mu    sync.Mutex       // guards kinds
	kinds map[string]*kind // by kind
}

type kind struct {
	last       time.Time
	suppressed int
}

// log writes msg at warn level unless a line of the same kind was written
// less than logEvery ago.
func (l *logLimiter) log(lg *slog.Logger, k, msg string, args ...any) {
	l.logLevel(lg, slog.LevelWarn, k, msg, args...)
}

func (l *logLimiter) logLevel(lg *slog.Logger, level slog.Level, k, msg string, args ...any) {
	now := time.Now()
	l.mu.Lock()
	if l.kinds == nil {
		l.kinds = make(map[string]*kind)
	}
	st := l.kinds[k]
	if st == nil {
		st = &kind{}
		l.kinds[k] = st
	}
	if !st.last.IsZero() && now.Sub(st.last) < logEvery {
		st.suppressed++
		l.mu.Unlock()
		return
	}
	n := st.suppressed
	st.last, st.suppressed = now, 0
	l.mu.Unlock()
	if n > 0 {
		args = append(args, "suppressed", n)
	}
	lg.Log(context.Background(), level, msg, args...)
}
