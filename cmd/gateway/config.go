package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/gateway"
	"github.com/allot/allot/pkg/redislimit"
)

// fileConfig is the -config YAML file. Unknown keys are errors.
//
//	upstream: http://127.0.0.1:9000
//	allocators: [10.0.0.1:7420, 10.0.0.2:7420]   # or -allocators; none = standalone
//	rules: [rules/public-api.yaml]               # standalone only: watched rules files
//	tls: {cert_file: gw.crt, key_file: gw.key}   # serve HTTPS
//	upstream_tls: {ca_file: ca.pem}
//	allocator_tls: {ca_file: ca.pem, cert_file: c.crt, key_file: c.key}
//	redis: {addrs: [127.0.0.1:6379], timeout: 5ms}  # rules with backend: redis (docs/redis.md)
//	domain: public-api                           # the rest is httplimit.Config
//	api_key: {headers: [Authorization, X-API-Key]}
//	descriptors: [[api_key]]
type fileConfig struct {
	Upstream     string    `yaml:"upstream"`
	Allocators   []string  `yaml:"allocators"`
	Rules        []string  `yaml:"rules"`
	TLS          tlsConfig `yaml:"tls"`
	UpstreamTLS  tlsConfig `yaml:"upstream_tls"`
	AllocatorTLS tlsConfig `yaml:"allocator_tls"`
	// Redis configures the backend of rules with `backend: redis`; without
	// it such rules are decided by a local bucket (docs/redis.md).
	Redis *redislimit.FileConfig `yaml:"redis"`
	// MaxRequestBodyBytes bounds a proxied request's body: larger is a 413
	// (before the upstream is called when Content-Length says so). 0 means
	// the default, 10 MiB; -1 means no limit.
	MaxRequestBodyBytes int64 `yaml:"max_request_body_bytes"`
	// RequestBodyTimeout bounds how long the proxy reads a request's body,
	// from the end of its headers: a slower body gets a 408 and the
	// upstream request is abandoned, so a slow client holds neither its
	// connection nor an upstream one for longer. 0 means the default,
	// 60 s; negative means no bound.
	RequestBodyTimeout time.Duration `yaml:"request_body_timeout"`

	httplimit.Config `yaml:",inline"`
}

// tlsConfig names PEM files. For the listener (tls) cert_file and key_file
// are required together; for the client sides (upstream_tls,
// allocator_tls) ca_file verifies the server and cert_file/key_file are an
// optional client certificate (mutual TLS).
type tlsConfig struct {
	CertFile           string `yaml:"cert_file"`
	KeyFile            string `yaml:"key_file"`
	CAFile             string `yaml:"ca_file"`
	ServerName         string `yaml:"server_name"`
	InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
	// minVersion raises the minimum TLS version (-tls-min-version; 0: 1.2).
	minVersion uint16
}

func (t tlsConfig) enabled() bool {
	return t.CertFile != "" || t.KeyFile != "" || t.CAFile != "" || t.ServerName != "" || t.InsecureSkipVerify
}

// serverTLS builds the listener's TLS config (nil when not configured).
func (t tlsConfig) serverTLS() (*tls.Config, error) {
	if !t.enabled() {
		return nil, nil
	}
	if t.CertFile == "" || t.KeyFile == "" {
		return nil, errors.New("tls: cert_file and key_file are both required")
	}
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if t.CAFile != "" { // client certificates required
		pool, err := loadPool(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// clientTLS builds a client-side TLS config (nil when not configured).
func (t tlsConfig) clientTLS(what string) (*tls.Config, error) {
	if !t.enabled() {
		return nil, nil
	}
	cfg := &tls.Config{ServerName: t.ServerName, InsecureSkipVerify: t.InsecureSkipVerify, MinVersion: max(tls.VersionTLS12, t.minVersion)}
	if t.CAFile != "" {
		pool, err := loadPool(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		cfg.RootCAs = pool
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		return nil, fmt.Errorf("%s: cert_file and key_file go together", what)
	}
	if t.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

func loadPool(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no PEM certificates", path)
	}
	return pool, nil
}

// loadConfig reads and strictly decodes a config file; errors read
// "file:line: message".
func loadConfig(path string) (fileConfig, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return fileConfig{}, err
	}
	return parseConfig(path, src)
}

func parseConfig(name string, src []byte) (fileConfig, error) {
	var cfg fileConfig
	dec := yaml.NewDecoder(bytes.NewReader(src))
	dec.KnownFields(true)
	if err := dec.Decode(&cfg); err != nil && !errors.Is(err, io.EOF) {
		return fileConfig{}, yamlError(name, err)
	}
	var extra yaml.Node
	switch err := dec.Decode(&extra); {
	case errors.Is(err, io.EOF):
	case err != nil:
		return fileConfig{}, yamlError(name, err)
	default:
		return fileConfig{}, fmt.Errorf("%s:%d: only one YAML document is allowed", name, extra.Line)
	}
	if _, err := httplimit.NewExtractor(cfg.Config); err != nil {
		var fe *httplimit.FieldError
		if errors.As(err, &fe) {
			if line := fieldLine(src, fe.Field); line > 0 {
				return fileConfig{}, fmt.Errorf("%s:%d: %w", name, line, err)
			}
		}
		return fileConfig{}, fmt.Errorf("%s: %w", name, err)
	}
	if cfg.MaxRequestBodyBytes < -1 {
		return fileConfig{}, fmt.Errorf("%s: max_request_body_bytes: must be -1 (no limit), 0 (default) or positive, got %d", name, cfg.MaxRequestBodyBytes)
	}
	if cfg.Redis != nil {
		if _, err := cfg.Redis.Config(); err != nil {
			return fileConfig{}, fmt.Errorf("%s: redis: %w", name, err)
		}
	}
	return cfg, nil
}

// fieldLine returns the line of a field path ("tier.default",
// "descriptors[0][1].value") in the YAML document src, or of the deepest
// part of it that is present: a bare entry such as "api_key" has no
// ".value". It returns 0 when not even the first part is present.
func fieldLine(src []byte, path string) int {
	var doc yaml.Node
	if yaml.Unmarshal(src, &doc) != nil || len(doc.Content) == 0 {
		return 0
	}
	n, line := doc.Content[0], 0
	for _, part := range strings.Split(path, ".") {
		name, idx, _ := strings.Cut(part, "[")
		next := (*yaml.Node)(nil)
		if n.Kind == yaml.MappingNode {
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == name {
					next, line = n.Content[i+1], n.Content[i].Line
				}
			}
		}
		if next == nil {
			return line
		}
		n = next
		for idx != "" {
			var is string
			is, idx, _ = strings.Cut(idx, "]")
			idx = strings.TrimPrefix(idx, "[")
			i, err := strconv.Atoi(is)
			if err != nil || n.Kind != yaml.SequenceNode || i < 0 || i >= len(n.Content) {
				return line
			}
			n, line = n.Content[i], n.Content[i].Line
		}
	}
	return line
}

var (
	lineRE    = regexp.MustCompile(`^line (\d+): (.*)$`)
	unknownRE = regexp.MustCompile(`^field (\S+) not found in type \S+$`)
)

// yamlError rewrites yaml.v3's "line N: ..." messages as "file:N: ...",
// and "field x not found in type T" as "x: unknown key". A message without
// a line (the reader's: control characters, invalid UTF-8) reads
// "file: ...".
func yamlError(name string, err error) error {
	var msgs []string
	var te *yaml.TypeError
	if errors.As(err, &te) {
		msgs = te.Errors
	} else {
		msgs = []string{strings.TrimPrefix(err.Error(), "yaml: ")}
	}
	var out []string
	for _, m := range msgs {
		if sm := lineRE.FindStringSubmatch(m); sm != nil {
			msg := sm[2]
			if um := unknownRE.FindStringSubmatch(msg); um != nil {
				msg = um[1] + ": unknown key"
			}
			out = append(out, fmt.Sprintf("%s:%s: %s", name, sm[1], msg))
			continue
		}
		out = append(out, name+": "+m)
	}
	return errors.New(strings.Join(out, "\n"))
}

// defaultRequestBodyTimeout is request_body_timeout's default.
const defaultRequestBodyTimeout = 60 * time.Second

// bodyTimeout returns the request body read bound, or 0 for none.
func (c fileConfig) bodyTimeout() time.Duration {
	return bound(c.RequestBodyTimeout, defaultRequestBodyTimeout)
}

// defaultMaxRequestBodyBytes is max_request_body_bytes' default.
const defaultMaxRequestBodyBytes = gateway.DefaultMaxRequestBodyBytes

// bodyLimit returns the request body bound, or 0 for none.
func (c fileConfig) bodyLimit() int64 {
	return bound(c.MaxRequestBodyBytes, defaultMaxRequestBodyBytes)
}

// bound reads a configured bound: negative is none (0), zero the default.
func bound[T int64 | time.Duration](v, def T) T {
	switch {
	case v < 0:
		return 0
	case v == 0:
		return def
	}
	return v
}
