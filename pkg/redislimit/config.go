package redislimit

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Modes of Config.Mode.
const (
	ModeSingle   = "single"   // one Redis server (Addrs has one address)
	ModeSentinel = "sentinel" // Sentinel-managed primary (Addrs are the sentinels; MasterName required)
	ModeCluster  = "cluster"  // Redis Cluster (Addrs are seed nodes)
)

// Config configures a Backend. Start from DefaultConfig; New calls Validate.
type Config struct {
	// Addrs are host:port addresses: the server (single), the sentinels
	// (sentinel) or seed nodes (cluster).
	Addrs []string
	// Mode is ModeSingle, ModeSentinel or ModeCluster; empty picks one as
	// go-redis's UniversalClient does: sentinel when MasterName is set,
	// cluster when there are several Addrs, else single.
	Mode string
	// MasterName is the Sentinel master name (sentinel mode).
	MasterName string
	// Username and Password authenticate to Redis (ACL or requirepass).
	Username, Password string
	// SentinelPassword authenticates to the sentinels, when they need it.
	SentinelPassword string
	// DB selects the database (single and sentinel modes; cluster has only 0).
	DB int
	// TLS, when set, is used for every connection.
	TLS *tls.Config

	// Timeout bounds each call to Redis, dialing included (default 5ms).
	// Raise it for TLS or a remote Redis: a dial that cannot finish within
	// it fails and counts against the breaker.
	Timeout time.Duration
	// PoolSize is the connections per node (default go-redis's, 10 per CPU).
	PoolSize int

	// BreakerFailures is the number of consecutive failed calls that opens
	// the circuit breaker (default 3). While it is open, calls fail at once
	// with ErrBreakerOpen and do no I/O.
	BreakerFailures int
	// BreakerCooldown is how long the breaker stays open before one probe
	// call is let through (default 250ms).
	BreakerCooldown time.Duration

	// KeyPrefix starts every Redis key (default "allot:"); it may not
	// contain '{' or '}'.
	KeyPrefix string
	// TTLSlack is added to each key's natural expiry to give its TTL
	// (default 1s). The TTL is only cleanup: the script checks the expiry
	// stored in the value.
	TTLSlack time.Duration
	// ServerTime makes the script read Redis's clock (TIME) instead of the
	// caller's. Off by default: every call then carries the agent's time,
	// which keeps the backend deterministic and testable but needs the
	// agents' clocks synchronised (NTP). See docs/redis.md.
	ServerTime bool

	// AgentID seeds shard affinity (Affinity); empty means a random seed.
	AgentID string
	// Affinity makes a sharded check try a sub-key fixed per (agent, key)
	// first instead of a random one. With many agents that spreads load as
	// evenly as random choice, with better locality; with few agents and
	// uneven load it causes more second tries.
	Affinity bool

	// Logger receives breaker transitions (default: discard).
	Logger *slog.Logger
	// Registerer, when set, receives the backend's metrics.
	Registerer prometheus.Registerer
	// Now is a test hook returning Unix ns (default time.Now). It stamps
	// calls that take no explicit time and drives the breaker's cooldown.
	Now func() int64
}

// DefaultConfig returns a Config for one Redis at 127.0.0.1:6379 with the
// defaults documented on each field.
func DefaultConfig() Config {
	return Config{
		Addrs:           []string{"127.0.0.1:6379"},
		Timeout:         5 * time.Millisecond,
		BreakerFailures: 3,
		BreakerCooldown: 250 * time.Millisecond,
		KeyPrefix:       "allot:",
		TTLSlack:        time.Second,
	}
}

// Validate reports the first problem with c.
func (c Config) Validate() error {
	if len(c.Addrs) == 0 {
		return errors.New("redislimit: at least one address is required")
	}
	for _, a := range c.Addrs {
		if a == "" {
			return errors.New("redislimit: empty address")
		}
	}
	switch c.Mode {
	case "":
	case ModeSingle:
		if len(c.Addrs) != 1 {
			return fmt.Errorf("redislimit: mode single takes one address, got %d", len(c.Addrs))
		}
		if c.MasterName != "" {
			return errors.New("redislimit: master_name is only for mode sentinel")
		}
	case ModeSentinel:
		if c.MasterName == "" {
			return errors.New("redislimit: mode sentinel needs master_name")
		}
	case ModeCluster:
		if c.MasterName != "" {
			return errors.New("redislimit: master_name is only for mode sentinel")
		}
		if c.DB != 0 {
			return errors.New("redislimit: Redis Cluster has only db 0")
		}
	default:
		return fmt.Errorf("redislimit: unknown mode %q (want single, sentinel or cluster)", c.Mode)
	}
	switch {
	case c.DB < 0:
		return fmt.Errorf("redislimit: db must be ≥ 0, got %d", c.DB)
	case c.Timeout <= 0:
		return fmt.Errorf("redislimit: timeout must be > 0, got %v", c.Timeout)
	case c.PoolSize < 0:
		return fmt.Errorf("redislimit: pool size must be ≥ 0, got %d", c.PoolSize)
	case c.BreakerFailures < 1:
		return fmt.Errorf("redislimit: breaker failures must be ≥ 1, got %d", c.BreakerFailures)
	case c.BreakerCooldown <= 0:
		return fmt.Errorf("redislimit: breaker cooldown must be > 0, got %v", c.BreakerCooldown)
	case strings.ContainsAny(c.KeyPrefix, "{}"):
		return fmt.Errorf("redislimit: key prefix %q may not contain '{' or '}'", c.KeyPrefix)
	case c.TTLSlack < time.Millisecond:
		return fmt.Errorf("redislimit: TTL slack must be ≥ 1ms, got %v", c.TTLSlack)
	}
	return nil
}

// mode returns the effective mode.
func (c Config) mode() string {
	switch {
	case c.Mode != "":
		return c.Mode
	case c.MasterName != "":
		return ModeSentinel
	case len(c.Addrs) > 1:
		return ModeCluster
	}
	return ModeSingle
}
