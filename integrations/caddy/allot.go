// Package allotcaddy is the Caddy v2 HTTP handler http.handlers.allot: the
// allot agent embedded in Caddy's process, deciding each request from
// leased tokens, with the HTTP contract of the gateway's proxy mode
// (agent/httplimit): allowed requests go on to the next handler with the
// RateLimit and RateLimit-Policy fields on the response; denied ones get
// the 429 (Retry-After, the fields, no-store, a JSON body) and never reach
// the next handler.
//
// It is its own Go module, so Caddy's dependency tree stays out of allot's.
// Build Caddy with it as xcaddy does (cmd/caddy is that main package):
//
//	xcaddy build --with github.com/allot/allot/integrations/caddy
//
// Caddyfile:
//
//	allot {
//		allocators 10.0.0.1:7420 10.0.0.2:7420   # or: rules /etc/allot/rules.yaml (standalone)
//		domain public-api
//		api_key_headers Authorization X-API-Key
//		trusted_proxies 10.0.0.0/8
//		routes /v1/search /v1/items/{id}
//		route_default other
//		tier_key k_free_demo free
//		tier_default free
//		descriptors tier api_key
//		descriptors tier route api_key
//		descriptors plan=header:X-Plan method
//	}
//
// An entry of descriptors is a source (api_key, client_ip, route, tier,
// method), key=source, key=header:Header-Name or key=value:constant. In
// JSON the handler takes the same fields as the gateway's config file
// (httplimit.Config) plus allocators, rules and agent_id.
package allotcaddy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
)

func init() {
	caddy.RegisterModule(Handler{})
	httpcaddyfile.RegisterHandlerDirective("allot", parseCaddyfile)
	// Before the handlers that answer (reverse_proxy, file_server...).
	httpcaddyfile.RegisterDirectiveOrder("allot", httpcaddyfile.Before, "reverse_proxy")
}

// closeTimeout bounds the agent's close (handing its leases back) when
// Caddy unloads the handler.
const closeTimeout = 5 * time.Second

// Handler is the http.handlers.allot module.
type Handler struct {
	// Allocators are the allocators' gRPC addresses. None: standalone,
	// with the rules from Rules.
	Allocators []string `json:"allocators,omitempty"`
	// Rules are rules files, for a standalone agent only.
	Rules []string `json:"rules,omitempty"`
	// AgentID is the agent's id at the allocators; empty: a unique one.
	AgentID string `json:"agent_id,omitempty"`
	// Config is the descriptor extraction, as the gateway's config file.
	httplimit.Config

	agent *agent.Agent
	mw    *httplimit.Middleware
}

// CaddyModule returns the module's information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.allot",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision starts the agent.
func (h *Handler) Provision(ctx caddy.Context) error {
	ex, err := httplimit.NewExtractor(h.Config)
	if err != nil {
		return err
	}
	cfg := agent.DefaultConfig()
	if h.AgentID != "" {
		cfg.ID = h.AgentID
	}
	cfg.Allocators = h.Allocators
	if len(h.Allocators) == 0 {
		cfg.RulesFiles = h.Rules
	}
	cfg.Logger = ctx.Slogger()
	if h.agent, err = agent.New(cfg); err != nil {
		return fmt.Errorf("allot: %w", err)
	}
	h.mw = &httplimit.Middleware{Checker: h.agent, Extractor: ex, Logger: ctx.Slogger()}
	return nil
}

// Validate checks the configuration.
func (h *Handler) Validate() error {
	switch {
	case len(h.Allocators) > 0 && len(h.Rules) > 0:
		return errors.New("allot: rules files are for a standalone agent: give allocators or rules, not both")
	case len(h.Allocators) == 0 && len(h.Rules) == 0:
		return errors.New("allot: give allocators, or rules files for a standalone agent")
	case len(h.Descriptors) == 0:
		return errors.New("allot: no descriptors: nothing would be limited")
	}
	return nil
}

// Cleanup closes the agent: its unspent leases go back to the allocators.
func (h *Handler) Cleanup() error {
	if h.agent == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	err := h.agent.Close(ctx)
	h.agent = nil
	return err
}

// ServeHTTP decides the request, then calls next or answers 429.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	var nextErr error
	h.mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		nextErr = next.ServeHTTP(w, r)
	})).ServeHTTP(w, r)
	return nextErr
}

// UnmarshalCaddyfile reads the allot block (see the package doc).
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		opt := d.Val()
		args := d.RemainingArgs()
		one := func() (string, error) {
			if len(args) != 1 {
				return "", d.Errf("%s takes one value", opt)
			}
			return args[0], nil
		}
		var err error
		switch opt {
		case "allocators":
			h.Allocators = append(h.Allocators, args...)
		case "rules":
			h.Rules = append(h.Rules, args...)
		case "agent_id":
			h.AgentID, err = one()
		case "domain":
			h.Domain, err = one()
		case "api_key_headers":
			h.APIKey.Headers = append(h.APIKey.Headers, args...)
		case "trusted_proxies":
			h.ClientIP.TrustedProxies = append(h.ClientIP.TrustedProxies, args...)
		case "forwarded_header":
			h.ClientIP.Header, err = one()
		case "routes":
			h.Routes.Paths = append(h.Routes.Paths, args...)
		case "route_default":
			h.Routes.Default, err = one()
		case "tier_header":
			h.Tier.Header, err = one()
		case "tier_key":
			if len(args) != 2 {
				return d.Errf("tier_key takes an API key and a tier")
			}
			if h.Tier.Keys == nil {
				h.Tier.Keys = map[string]string{}
			}
			h.Tier.Keys[args[0]] = args[1]
		case "tier_default":
			h.Tier.Default, err = one()
		case "max_value_bytes":
			var v string
			if v, err = one(); err == nil {
				if h.MaxValueBytes, err = strconv.Atoi(v); err != nil {
					return d.Errf("max_value_bytes: %q is not an integer", v)
				}
			}
		case "descriptors":
			if len(args) == 0 {
				return d.Errf("descriptors needs at least one entry")
			}
			desc := make(httplimit.DescriptorConfig, 0, len(args))
			for _, a := range args {
				e, perr := parseEntry(a)
				if perr != nil {
					return d.Errf("descriptors: %v", perr)
				}
				desc = append(desc, e)
			}
			h.Descriptors = append(h.Descriptors, desc)
		default:
			return d.Errf("unknown allot option %q", opt)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// parseEntry reads one descriptor entry: source, key=source,
// key=header:Name or key=value:constant.
func parseEntry(s string) (httplimit.EntryConfig, error) {
	key, spec, named := strings.Cut(s, "=")
	if !named {
		key, spec = "", s
	}
	if named && key == "" {
		return httplimit.EntryConfig{}, fmt.Errorf("%q: empty key", s)
	}
	switch {
	case strings.HasPrefix(spec, "header:"):
		return httplimit.EntryConfig{Key: key, Source: httplimit.SourceHeader, Header: strings.TrimPrefix(spec, "header:")}, nil
	case strings.HasPrefix(spec, "value:"):
		return httplimit.EntryConfig{Key: key, Source: httplimit.SourceStatic, Value: strings.TrimPrefix(spec, "value:")}, nil
	}
	return httplimit.EntryConfig{Key: key, Source: httplimit.Source(spec)}, nil
}

func parseCaddyfile(hb httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	h := new(Handler)
	err := h.UnmarshalCaddyfile(hb.Dispenser)
	return h, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddyfile.Unmarshaler       = (*Handler)(nil)
)
