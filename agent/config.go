package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Config configures an Agent. Start from DefaultConfig; New calls Validate.
type Config struct {
	// ID identifies this agent incarnation to the allocator; it must be
	// unique per process start. Default: hostname-pid-random. At most 256
	// bytes.
	ID string
	// Allocators are the gRPC addresses of allocator nodes (any member
	// works: the refill loop then follows the leader a member names, see
	// the package doc). Empty (and no Clients): standalone, every decision
	// is local (Rules/RulesFiles).
	Allocators []string
	// DialOptions are added to every allocator connection. Without transport
	// credentials among them, connections are insecure (plaintext).
	DialOptions []grpc.DialOption
	// Clients, when set, are used as the allocator connections instead of
	// dialing Allocators: an in-memory transport for simulators and tests.
	// Allocators may then be empty (the clients are named "client-0", …)
	// or give one name per client, for logs. The agent never closes them.
	Clients []allotv1.AllocatorClient

	// Rules is the initial rule set: the only rules in standalone mode
	// without RulesFiles, or the rules served until the allocator's
	// WatchRules stream delivers its set. May be nil (matches nothing).
	Rules *rules.Set
	// RulesFiles, standalone only, are YAML rules files compiled together
	// (with Rules' files, if any) and watched: a change (mtime, size or
	// content) is recompiled every RulesPollInterval, and a file that fails
	// to compile keeps the old rules (logged, counted).
	RulesFiles []string
	// RulesPollInterval is how often RulesFiles are checked. Default 1s.
	RulesPollInterval time.Duration

	// RefillInterval is the refill loop's tick. Default 50ms. A key at its
	// limit shared by 20 agents or more is paced (see the package doc) and
	// asks at most every k·10 ms; with fewer agents it owes a charge on
	// most ticks, so the tick sets the call rate (bench/load -workload hot
	// -refill-interval D measures it).
	RefillInterval time.Duration
	// ScanInterval is how often the refill loop scans the keys that need
	// it (demand EWMA, expiry, idle keys; a key at rest is visited again
	// only at its next deadline or when a check touches it); keys that
	// need the allocator sooner are queued by the check path and sent at
	// the next tick. Default 100ms, never less than RefillInterval.
	ScanInterval time.Duration
	// CallTimeout bounds each Acquire call; a timeout counts towards the
	// breaker. Default 1s: a loaded allocator's commit tail reaches a few
	// hundred ms, and checks never wait on the call anyway.
	CallTimeout time.Duration
	// FailureThreshold is the number of consecutive failed calls that opens
	// the circuit breaker. Default 3.
	FailureThreshold int
	// ProbeBackoff and MaxProbeBackoff bound the breaker's jittered
	// exponential backoff between probes while open. Defaults 100ms and 2s.
	ProbeBackoff, MaxProbeBackoff time.Duration
	// IdleTimeout: a key not checked for this long hands back its lease
	// balance and is forgotten. Default 10s.
	IdleTimeout time.Duration
	// MaxOutageKeys bounds the key table against keys kept only for the
	// outage charge they owe: the fallback admissions made while the
	// allocator was unreachable, reported once it is back. While the
	// table holds more keys than this, a key idle for IdleTimeout whose
	// only debt is its outage charge is forgotten and the charge forgiven
	// (counted in allot_agent_outage_forgiven_tokens_total), so that a
	// client sending a fresh key per request during an outage cannot grow
	// the table without bound. Default 100000.
	MaxOutageKeys int

	// StaticShares asks the allocator for a static-share slot with every
	// Acquire (docs/static-shares.md): while the allocator grants one, keys
	// of static-eligible rules that no agent coordinates are decided from
	// a share of their limit (SourceStatic) with no call and no charge, and
	// promoted to leases when their share runs low. An agent holding a
	// slot and nothing else to send sends an Acquire without keys every
	// half of the allocator's static TTL. Not asked while the agent routes
	// to several allocator data groups. Default (DefaultConfig) true; it
	// has no effect on an allocator that runs without static shares.
	StaticShares bool

	// Redis, when set, decides keys whose rule has the redis backend (a
	// shared counter checked per request). Nil: such keys are decided by a
	// local per-agent bucket at the full rate, like the local backend.
	Redis RemoteLimiter

	// Logger receives state changes (rate-limited). Nil: discard.
	Logger *slog.Logger
	// Registerer, when set, receives the agent's metrics. Nil: metrics are
	// kept but not registered.
	Registerer prometheus.Registerer
	// Now returns the current time in Unix nanoseconds. It is a test hook:
	// nil (the default) uses a coarse clock ticked every millisecond by an
	// owned goroutine while checks read it often, so that a busy agent's
	// checks do not read the system clock (see coarseClock).
	Now func() int64

	// Rand is the source of the jitter in the breaker's probe backoff and
	// the rule watch's reconnect backoff. Nil: math/rand/v2's global source.
	// The agent serialises its use.
	Rand *rand.Rand

	// driven (agentsim.New) starts no goroutine at all: no coarse clock
	// (Now is required), no refill loop, no rule watch; the caller drives
	// the refill loop and delivers rule sets (see package agentsim).
	driven bool

	// manual, for tests in this package, starts no refill goroutine: the
	// test drives the refill loop with Agent.refillOnce.
	manual bool
}

// Limits on Check's input; beyond them Check returns ErrInvalid.
const (
	MaxDescriptors = 64                     // descriptors per check
	MaxEntries     = 64                     // entries per descriptor
	MaxKeyBytes    = allotv1.MaxKeyBytes    // domain + entries of one descriptor (len(k)+len(v)+2 each): the protocol's bound
	maxIDLen       = allotv1.MaxIDBytes     // bytes of Config.ID
	maxBatchKeys   = allotv1.MaxKeysPerCall // keys per Acquire or Release
)

// ErrInvalid is wrapped by every error Check and CheckStatuses return: the
// input itself is unusable (empty domain, no descriptors, an empty entry
// key, too many descriptors or entries, a descriptor longer than
// MaxKeyBytes, a domain, entry key or value that is not rules.ValidText).
var ErrInvalid = errors.New("agent: invalid request")

// DefaultConfig returns the defaults: standalone (no allocators), a fresh
// ID, 50ms refill ticks, 1s call timeout, breaker after 3 failures, at most
// 100000 keys before outage charges are forgiven, static shares asked for.
func DefaultConfig() Config {
	return Config{
		ID:                defaultID(),
		RulesPollInterval: time.Second,
		RefillInterval:    50 * time.Millisecond,
		ScanInterval:      100 * time.Millisecond,
		CallTimeout:       time.Second,
		FailureThreshold:  3,
		ProbeBackoff:      100 * time.Millisecond,
		MaxProbeBackoff:   2 * time.Second,
		IdleTimeout:       10 * time.Second,
		MaxOutageKeys:     100_000,
		StaticShares:      true,
	}
}

func defaultID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "agent"
	}
	if len(host) > 200 {
		host = host[:200]
	}
	return fmt.Sprintf("%s-%d-%08x", host, os.Getpid(), rand.Uint32())
}

// withDefaults fills zero durations and counts with the defaults, so a
// Config built by hand (not from DefaultConfig) still works.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.ID == "" {
		c.ID = d.ID
	}
	if c.RulesPollInterval == 0 {
		c.RulesPollInterval = d.RulesPollInterval
	}
	if c.RefillInterval == 0 {
		c.RefillInterval = d.RefillInterval
	}
	if c.ScanInterval == 0 {
		c.ScanInterval = d.ScanInterval
	}
	if c.ScanInterval < c.RefillInterval {
		c.ScanInterval = c.RefillInterval
	}
	if c.CallTimeout == 0 {
		c.CallTimeout = d.CallTimeout
	}
	if c.FailureThreshold == 0 {
		c.FailureThreshold = d.FailureThreshold
	}
	if c.ProbeBackoff == 0 {
		c.ProbeBackoff = d.ProbeBackoff
	}
	if c.MaxProbeBackoff == 0 {
		c.MaxProbeBackoff = d.MaxProbeBackoff
	}
	if c.MaxProbeBackoff < c.ProbeBackoff {
		c.MaxProbeBackoff = c.ProbeBackoff
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = d.IdleTimeout
	}
	if c.MaxOutageKeys == 0 {
		c.MaxOutageKeys = d.MaxOutageKeys
	}
	return c
}

// Validate reports a configuration error. Zero durations and counts are
// valid (they take the defaults); negative ones are not.
func (c Config) Validate() error {
	if len(c.ID) > maxIDLen {
		return fmt.Errorf("agent: ID is %d bytes, at most %d", len(c.ID), maxIDLen)
	}
	if !rules.ValidText(c.ID) {
		return errors.New("agent: ID is not valid UTF-8 text (control characters or invalid bytes)")
	}
	for i, a := range c.Allocators {
		if a == "" {
			return fmt.Errorf("agent: Allocators[%d] is empty", i)
		}
	}
	for i, cl := range c.Clients {
		if cl == nil {
			return fmt.Errorf("agent: Clients[%d] is nil", i)
		}
	}
	if len(c.Clients) > 0 && len(c.Allocators) > 0 && len(c.Allocators) != len(c.Clients) {
		return fmt.Errorf("agent: %d Allocators names for %d Clients", len(c.Allocators), len(c.Clients))
	}
	if c.driven && c.Now == nil {
		return errors.New("agentsim: Config.Now is required (there is no clock goroutine)")
	}
	if c.driven && len(c.RulesFiles) > 0 {
		return errors.New("agentsim: an agent with no goroutines cannot watch RulesFiles")
	}
	if (len(c.Allocators) > 0 || len(c.Clients) > 0) && len(c.RulesFiles) > 0 {
		return errors.New("agent: RulesFiles is for standalone agents; with Allocators the rules come from WatchRules")
	}
	for i, f := range c.RulesFiles {
		if f == "" {
			return fmt.Errorf("agent: RulesFiles[%d] is empty", i)
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"RulesPollInterval", c.RulesPollInterval},
		{"RefillInterval", c.RefillInterval},
		{"ScanInterval", c.ScanInterval},
		{"CallTimeout", c.CallTimeout},
		{"ProbeBackoff", c.ProbeBackoff},
		{"MaxProbeBackoff", c.MaxProbeBackoff},
		{"IdleTimeout", c.IdleTimeout},
	} {
		if d.v < 0 {
			return fmt.Errorf("agent: %s must not be negative, got %v", d.name, d.v)
		}
	}
	if c.FailureThreshold < 0 {
		return fmt.Errorf("agent: FailureThreshold must not be negative, got %d", c.FailureThreshold)
	}
	if c.MaxOutageKeys < 0 {
		return fmt.Errorf("agent: MaxOutageKeys must not be negative, got %d", c.MaxOutageKeys)
	}
	return nil
}
