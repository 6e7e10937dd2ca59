package redislimit

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"time"
)

// FileConfig is the `redis:` block of a YAML configuration file, for
// cmd/ wiring:
//
//	redis:
//	  addrs: [10.0.0.1:6379]
//	  mode: single            # single | sentinel | cluster (empty: auto)
//	  master_name: ""         # sentinel mode
//	  username: allot
//	  password: secret
//	  tls: {ca_file: ca.pem, cert_file: c.pem, key_file: k.pem, server_name: redis.internal}
//	  timeout: 5ms
//	  breaker: {failures: 3, cooldown: 250ms}
//	  server_time: false
//	  batched: {max_batch: 64, horizon: 50ms, hold: 250ms}   # optional: batched mode
//	  promote: {threshold: 5000, shards: 8, ttl: 30s}        # optional: hot-key promotion
//
// Durations are Go durations ("5ms"). Zero fields keep DefaultConfig's
// values.
type FileConfig struct {
	Addrs            []string       `yaml:"addrs"`
	Mode             string         `yaml:"mode"`
	MasterName       string         `yaml:"master_name"`
	Username         string         `yaml:"username"`
	Password         string         `yaml:"password"`
	SentinelPassword string         `yaml:"sentinel_password"`
	DB               int            `yaml:"db"`
	TLS              *TLSFileConfig `yaml:"tls"`
	Timeout          time.Duration  `yaml:"timeout"`
	PoolSize         int            `yaml:"pool_size"`
	Breaker          struct {
		Failures int           `yaml:"failures"`
		Cooldown time.Duration `yaml:"cooldown"`
	} `yaml:"breaker"`
	KeyPrefix  string        `yaml:"key_prefix"`
	TTLSlack   time.Duration `yaml:"ttl_slack"`
	ServerTime bool          `yaml:"server_time"`
	Affinity   bool          `yaml:"affinity"`
	Batched    *struct {
		MaxBatch int64         `yaml:"max_batch"`
		Horizon  time.Duration `yaml:"horizon"`
		Hold     time.Duration `yaml:"hold"`
		MaxKeys  int           `yaml:"max_keys"`
	} `yaml:"batched"`
	Promote *struct {
		Threshold float64       `yaml:"threshold"`
		Shards    int           `yaml:"shards"`
		HalfLife  time.Duration `yaml:"half_life"`
		TTL       time.Duration `yaml:"ttl"`
		MaxKeys   int           `yaml:"max_keys"`
	} `yaml:"promote"`
}

// TLSFileConfig configures TLS from PEM files.
type TLSFileConfig struct {
	CAFile             string `yaml:"ca_file"`   // verifies the server; empty: system roots
	CertFile           string `yaml:"cert_file"` // client certificate (with KeyFile), optional
	KeyFile            string `yaml:"key_file"`
	ServerName         string `yaml:"server_name"`
	InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
}

// Config returns the Backend configuration f describes (DefaultConfig with
// f's non-zero fields), validated; TLS files are read here.
func (f FileConfig) Config() (Config, error) {
	c := DefaultConfig()
	if len(f.Addrs) > 0 {
		c.Addrs = f.Addrs
	}
	c.Mode, c.MasterName, c.DB = f.Mode, f.MasterName, f.DB
	c.Username, c.Password, c.SentinelPassword = f.Username, f.Password, f.SentinelPassword
	c.ServerTime, c.Affinity = f.ServerTime, f.Affinity
	set := func(dst *time.Duration, v time.Duration) {
		if v != 0 {
			*dst = v
		}
	}
	set(&c.Timeout, f.Timeout)
	set(&c.BreakerCooldown, f.Breaker.Cooldown)
	set(&c.TTLSlack, f.TTLSlack)
	if f.PoolSize != 0 {
		c.PoolSize = f.PoolSize
	}
	if f.Breaker.Failures != 0 {
		c.BreakerFailures = f.Breaker.Failures
	}
	if f.KeyPrefix != "" {
		c.KeyPrefix = f.KeyPrefix
	}
	if f.TLS != nil {
		t, err := f.TLS.load()
		if err != nil {
			return Config{}, err
		}
		c.TLS = t
	}
	return c, c.Validate()
}

// BatchConfig returns the batched-mode configuration, and false when the
// file does not enable batched mode.
func (f FileConfig) BatchConfig() (BatchConfig, bool, error) {
	if f.Batched == nil {
		return BatchConfig{}, false, nil
	}
	c := DefaultBatchConfig()
	if f.Batched.MaxBatch != 0 {
		c.MaxBatch = f.Batched.MaxBatch
	}
	if f.Batched.Horizon != 0 {
		c.Horizon = f.Batched.Horizon
	}
	if f.Batched.Hold != 0 {
		c.Hold = f.Batched.Hold
	}
	if f.Batched.MaxKeys != 0 {
		c.MaxKeys = f.Batched.MaxKeys
	}
	return c, true, c.Validate()
}

// PromoterConfig returns the promotion configuration, and false when the
// file does not enable promotion.
func (f FileConfig) PromoterConfig() (PromoterConfig, bool, error) {
	if f.Promote == nil {
		return PromoterConfig{}, false, nil
	}
	c := DefaultPromoterConfig()
	c.Threshold = f.Promote.Threshold
	if f.Promote.Shards != 0 {
		c.Shards = f.Promote.Shards
	}
	if f.Promote.HalfLife != 0 {
		c.HalfLife = f.Promote.HalfLife
	}
	if f.Promote.TTL != 0 {
		c.TTL = f.Promote.TTL
	}
	if f.Promote.MaxKeys != 0 {
		c.MaxKeys = f.Promote.MaxKeys
	}
	return c, true, c.Validate()
}

func (t *TLSFileConfig) load() (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName, InsecureSkipVerify: t.InsecureSkipVerify}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("redislimit: tls ca_file: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("redislimit: tls ca_file %s: no PEM certificates", t.CAFile)
		}
	}
	switch {
	case t.CertFile != "" && t.KeyFile != "":
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("redislimit: tls client certificate: %w", err)
		}
		c.Certificates = []tls.Certificate{cert}
	case t.CertFile != "" || t.KeyFile != "":
		return nil, errors.New("redislimit: tls cert_file and key_file go together")
	}
	return c, nil
}
