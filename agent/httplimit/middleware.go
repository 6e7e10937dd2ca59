// Package httplimit is allot's HTTP contract: net/http middleware that
// extracts rate limit descriptors from each request, asks a Checker (the
// embedded agent) for a decision, and either forwards the request with the
// IETF RateLimit and RateLimit-Policy fields, or answers 429 itself.
//
// The Middleware follows net/http/httputil.ReverseProxy: a struct whose
// optional hooks (Descriptors, OnDenied, ErrorHandler, OnShadow) each have a
// documented nil default. Descriptor extraction is declared by a Config
// (YAML) and compiled by NewExtractor.
//
// # The contract
//
// Allowed: the request is forwarded with
//
//	RateLimit-Policy: "<name>";q=<quota>;w=<window seconds>
//	RateLimit: "<name>";r=<remaining>;t=<seconds until more quota>
//
// Denied: 429 without calling the next handler, with Retry-After
// (delay-seconds, the retry delay rounded up, at least 1), the same two
// fields (t then equals Retry-After; a deny-all rule, requests_per_unit: 0,
// has q=0), Cache-Control: no-store,
// Content-Type: application/json and the body DeniedBody.
//
// The reported policy is the agent's Decision: the denying limit with the
// longest wait, or, when allowed, the enforced limit with the lowest
// remaining. Limits in shadow
// mode never deny and are never advertised. A request whose values exceed
// the bounds or are not valid text (rules.ValidText), or that the agent
// refuses as invalid (agent.ErrInvalid), gets a 400 JSON answer. A limiter error never turns into a 5xx:
// the request is forwarded without fields (fail open); rules with
// failure_mode closed are enforced by the agent itself.
package httplimit

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/sfv"
)

// Checker decides a request. *agent.Agent implements it. Check must not
// retain descs (or their entries) after it returns: the middleware reuses
// them.
type Checker interface {
	Check(ctx context.Context, domain string, descs []agent.Descriptor, hits uint32) (agent.Decision, error)
}

// DeniedBody is the exact body of a 429.
const DeniedBody = `{"error":"rate_limited","message":"API rate limit exceeded for this key."}`

var deniedBodyLen = strconv.Itoa(len(DeniedBody))

// Header names (canonical forms; field names are case-insensitive).
const (
	HeaderRateLimit       = "Ratelimit"        // RateLimit
	HeaderRateLimitPolicy = "Ratelimit-Policy" // RateLimit-Policy
)

// Middleware rate-limits requests in front of a handler. Checker and
// either Extractor or Descriptors must be set; every other field is
// optional. A Middleware must not be modified after its first use.
type Middleware struct {
	// Checker decides (required).
	Checker Checker
	// Domain is the rules domain; empty means Extractor.Domain().
	Domain string
	// Extractor extracts descriptors as configured. Used when Descriptors
	// is nil.
	Extractor *Extractor
	// Descriptors, when set, replaces Extractor: it returns the request's
	// descriptors, or an error. Errors wrapping ErrBadRequest become 400s;
	// other errors fail open. An empty result forwards the request
	// unchecked.
	Descriptors func(r *http.Request) ([]agent.Descriptor, error)
	// Hits returns the tokens the request costs. Nil means 1.
	Hits func(r *http.Request) uint32
	// OnDenied writes the response to a denied request. Nil means
	// WriteDenied (the 429 of the contract). The RateLimit fields are
	// already set on w.Header() when it is called.
	OnDenied func(w http.ResponseWriter, r *http.Request, d agent.Decision)
	// OnShadow is called for a request that a shadow-mode limit would have
	// denied (it is forwarded). Nil means a debug log line.
	OnShadow func(r *http.Request, d agent.Decision)
	// ErrorHandler answers requests whose descriptors could not be
	// extracted or checked because of the request itself (errors wrapping
	// ErrBadRequest). Nil means WriteBadRequest (400 JSON).
	ErrorHandler func(w http.ResponseWriter, r *http.Request, err error)
	// Logger receives shadow hits (debug) and limiter errors (warn, at most
	// one line a second). Nil means slog.Default().
	Logger *slog.Logger
	// Metrics counts decisions. Nil means no metrics.
	Metrics *Metrics

	lastErrLog atomic.Int64 // unix nanos of the last limiter-error log line
}

// scratch holds one request's descriptors and entries; pooled.
type scratch struct {
	descs   []agent.Descriptor
	entries []rules.Entry
	field   []byte
}

var scratchPool = sync.Pool{New: func() any {
	return &scratch{
		descs:   make([]agent.Descriptor, 0, MaxDescriptors),
		entries: make([]rules.Entry, 0, MaxDescriptors*MaxEntries),
		field:   make([]byte, 0, 256),
	}
}}

// Wrap returns next behind the limiter.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next, nil)
	})
}

func (m *Middleware) logger() *slog.Logger {
	if m.Logger != nil {
		return m.Logger
	}
	return slog.Default()
}

// serve decides r and calls next when it is allowed. A request with no
// descriptor goes to none when it is set, else to next (unchecked).
func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next, none http.Handler) {
	sc := scratchPool.Get().(*scratch)
	defer func() {
		// Drop the request's strings (only the used prefix: clearing the
		// whole arrays costs write barriers while the GC runs).
		clear(sc.descs)
		clear(sc.entries)
		sc.descs, sc.entries = sc.descs[:0], sc.entries[:0]
		scratchPool.Put(sc)
	}()

	var descs []agent.Descriptor
	var err error
	domain := m.Domain
	if m.Descriptors != nil {
		descs, err = m.Descriptors(r)
	} else if m.Extractor != nil {
		sc.descs, sc.entries, err = m.Extractor.extract(r, sc.descs[:0], sc.entries[:0])
		descs = sc.descs
		if domain == "" {
			domain = m.Extractor.domain
		}
	}
	if err != nil {
		if errors.Is(err, ErrBadRequest) {
			m.badRequest(w, r, err)
			return
		}
		m.limiterError(err)
		next.ServeHTTP(w, r)
		return
	}
	if len(descs) == 0 || domain == "" {
		if none != nil {
			none.ServeHTTP(w, r)
			return
		}
		m.Metrics.inc(resultUnlimited)
		next.ServeHTTP(w, r)
		return
	}
	hits := uint32(1)
	if m.Hits != nil {
		hits = m.Hits(r)
	}
	d, err := m.Checker.Check(r.Context(), domain, descs, hits)
	if errors.Is(err, agent.ErrInvalid) {
		// The descriptors themselves are unusable (a Descriptors hook
		// passed bytes the extractor would refuse): a bad request.
		err = &BadRequestError{Message: "the request's rate-limit descriptors are invalid"}
	}
	if err != nil {
		if errors.Is(err, ErrBadRequest) {
			m.badRequest(w, r, err)
			return
		}
		m.limiterError(err)
		next.ServeHTTP(w, r)
		return
	}
	sc.field = SetFields(w.Header(), d, sc.field)
	switch {
	case !d.Allowed:
		m.Metrics.inc(resultDenied)
		if m.OnDenied != nil {
			m.OnDenied(w, r, d)
		} else {
			WriteDenied(w, r, d)
		}
		return
	case d.Shadow:
		m.Metrics.inc(resultShadow)
		if m.OnShadow != nil {
			m.OnShadow(r, d)
		} else if l := m.logger(); l.Enabled(r.Context(), slog.LevelDebug) {
			l.LogAttrs(r.Context(), slog.LevelDebug, "httplimit: shadow limit exceeded, request forwarded",
				slog.String("domain", domain), slog.String("policy", d.Policy)) // no path: it may carry keys
		}
	case d.Rule == nil:
		m.Metrics.inc(resultUnlimited)
	default:
		m.Metrics.inc(resultAllowed)
	}
	next.ServeHTTP(w, r)
}

// badRequest counts and answers a request the extraction refused.
func (m *Middleware) badRequest(w http.ResponseWriter, r *http.Request, err error) {
	m.Metrics.inc(resultBadRequest)
	if m.ErrorHandler != nil {
		m.ErrorHandler(w, r, err)
	} else {
		WriteBadRequest(w, r, err)
	}
}

func (m *Middleware) limiterError(err error) {
	m.Metrics.inc(resultError)
	now := time.Now().UnixNano()
	last := m.lastErrLog.Load()
	if now-last >= int64(time.Second) && m.lastErrLog.CompareAndSwap(last, now) {
		m.logger().Warn("httplimit: limiter error, request forwarded (fail open)", "err", err)
	}
}

// ceilSeconds rounds d up to whole seconds, saturating.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	s := int64(d / time.Second)
	if d%time.Second != 0 {
		s++
	}
	return s
}

// MaxRetryAfter is the longest retry delay the transports advertise. A
// request of more tokens than its rule's burst can never be admitted
// (bucket.Never); it is told to wait this long, the longest window a rule
// can have (bucket.MaxWindow, about 36.5 years), rather than the 292 years
// of bucket.Never. No wait a limit computes for an admissible request is
// longer, so the clamp never shortens one.
const MaxRetryAfter = bucket.MaxWindow

// RetryAfterSeconds is the Retry-After value for a denial: the retry delay
// rounded up to whole seconds, at least 1, at most MaxRetryAfter's.
func RetryAfterSeconds(d agent.Decision) int64 {
	s := ceilSeconds(min(d.RetryAfter, MaxRetryAfter))
	if s < 1 {
		s = 1
	}
	return s
}

// reported reports whether d's limit is advertised: a limited rule that is
// not in shadow mode. A deny-all rule (requests_per_unit: 0) is advertised
// with q=0, which draft 10 allows (q is a non-negative Integer).
func reported(d agent.Decision) bool {
	if d.Rule == nil || d.Policy == "" || d.Quota < 0 || (d.Quota == 0 && !d.Rule.DenyAll) {
		return false
	}
	return !d.Rule.ShadowMode
}

// SetFields sets RateLimit-Policy and RateLimit on h for decision d (and
// deletes them when d reports no limit). buf is scratch space, returned for
// reuse. t is the seconds until more quota is available when allowed
// (Decision.NextAfter rounded up: the next token, or the next window
// boundary; 0 when the limit is full), and equals Retry-After when denied.
func SetFields(h http.Header, d agent.Decision, buf []byte) []byte {
	buf, n, ok := AppendFields(buf[:0], d)
	if !ok {
		delete(h, HeaderRateLimit)
		delete(h, HeaderRateLimitPolicy)
		return buf
	}
	var vals []string
	if len(buf) <= fieldTextCap {
		// One allocation backs both values and their bytes.
		fv := new(fieldValues)
		copy(fv.text[:], buf)
		fv.vals[0] = unsafe.String(&fv.text[0], n)
		fv.vals[1] = unsafe.String(&fv.text[n+2], len(buf)-n-2)
		vals = fv.vals[:]
	} else {
		all := string(buf)
		vals = []string{all[:n], all[n+2:]}
	}
	h[HeaderRateLimitPolicy] = vals[0:1:1]
	h[HeaderRateLimit] = vals[1:2:2]
	return buf
}

// AppendFields appends the RateLimit-Policy value for decision d to buf,
// then ", " and the RateLimit value, and returns the result with the
// length of the RateLimit-Policy value: buf[:n] is RateLimit-Policy and
// buf[n+2:] is RateLimit. ok is false (and buf unchanged) when d reports
// no limit. Every transport of the contract (HTTP, forward-auth, gRPC
// metadata) writes the fields from here.
func AppendFields(buf []byte, d agent.Decision) (_ []byte, n int, ok bool) {
	if !reported(d) {
		return buf, 0, false
	}
	start := len(buf)
	buf = sfv.AppendPolicy(buf, d.Policy, d.Quota, ceilSeconds(d.Window))
	n = len(buf) - start
	t := ceilSeconds(d.NextAfter)
	if !d.Allowed {
		t = RetryAfterSeconds(d)
	}
	// buf is not empty: AppendRateLimit writes the ", " separator first.
	return sfv.AppendRateLimit(buf, d.Policy, d.Remaining, t), n, true
}

// fieldTextCap is the longest pair of field values (with the ", " between
// them) that one fieldValues holds; the object is 128 bytes, a size class.
// Longer values (long policy names) take two allocations.
const fieldTextCap = 96

// fieldValues is one response's RateLimit-Policy and RateLimit values: the
// header map's []string entries and the bytes of both strings in one
// allocation. text is written once, before the strings are made, and never
// again (the strings alias it), so the strings are immutable as Go requires.
type fieldValues struct {
	vals [2]string
	text [fieldTextCap]byte
}

// WriteDenied writes the contract's 429: Retry-After, Cache-Control:
// no-store, a JSON DeniedBody. The RateLimit fields are expected on
// w.Header() already (SetFields).
func WriteDenied(w http.ResponseWriter, _ *http.Request, d agent.Decision) {
	h := w.Header()
	vals := [...]string{strconv.FormatInt(RetryAfterSeconds(d), 10), "no-store", "application/json", deniedBodyLen}
	h["Retry-After"] = vals[0:1:1]
	h["Cache-Control"] = vals[1:2:2]
	h["Content-Type"] = vals[2:3:3]
	h["Content-Length"] = vals[3:4:4]
	w.WriteHeader(http.StatusTooManyRequests)
	_, _ = io.WriteString(w, DeniedBody)
}

// WriteBadRequest writes a 400 with a JSON body naming the problem (the
// fixed message of a *BadRequestError, never request bytes).
func WriteBadRequest(w http.ResponseWriter, _ *http.Request, err error) {
	msg := "The request could not be rate limited."
	var bre *BadRequestError
	if errors.As(err, &bre) {
		msg = bre.Message
	}
	body := `{"error":"bad_request","message":` + strconv.Quote(msg) + `}`
	h := w.Header()
	delete(h, HeaderRateLimit)
	delete(h, HeaderRateLimitPolicy)
	h["Cache-Control"] = []string{"no-store"}
	h["Content-Type"] = []string{"application/json"}
	h["Content-Length"] = []string{strconv.Itoa(len(body))}
	w.WriteHeader(http.StatusBadRequest)
	_, _ = w.Write([]byte(body))
}
