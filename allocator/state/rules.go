package state

import (
	"fmt"

	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/rules/rulespb"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// applyPutRules compiles and installs a new rule set (version = current+1,
// or req.Version when set: a data group following the meta group).
// Without replace_all only the domains named by the files are replaced. A
// compile error wraps ErrInvalid and names file:line; an expected_version
// mismatch wraps ErrFailedPrecondition; dry_run validates and changes
// nothing. Keys keep their state across versions while their limit's
// parameters do not change.
func (c *core) applyPutRules(req *allotv1.PutRulesRequest, now int64) (*allotv1.PutRulesResponse, error) {
	if req == nil {
		return nil, fmt.Errorf("%w: nil put_rules", ErrInvalid)
	}
	cur := c.rulesVersion()
	if req.ExpectedVersion != 0 && req.ExpectedVersion != cur {
		return nil, fmt.Errorf("%w: rules version is %d, expected %d", ErrFailedPrecondition, cur, req.ExpectedVersion)
	}
	if len(req.Files) == 0 && !req.ReplaceAll {
		return nil, fmt.Errorf("%w: no rule files (replace_all with no files removes every domain)", ErrInvalid)
	}
	if len(req.Files) > maxRuleFile {
		return nil, fmt.Errorf("%w: %d rule files, at most %d", ErrInvalid, len(req.Files), maxRuleFile)
	}
	files := make([]rules.File, 0, len(req.Files))
	size := 0
	for _, f := range req.Files {
		if f == nil {
			return nil, fmt.Errorf("%w: nil rule file", ErrInvalid)
		}
		size += len(f.Yaml)
		files = append(files, rules.File{Name: f.Name, Domain: f.Domain, Source: f.Yaml})
	}
	if size > maxRuleYAML {
		return nil, fmt.Errorf("%w: rules are %d bytes, at most %d", ErrInvalid, size, maxRuleYAML)
	}
	version := cur + 1
	if req.Version != 0 {
		// A data group installing the meta group's rule set at its version.
		if req.Version <= cur {
			return nil, fmt.Errorf("%w: rules version is %d, not below %d", ErrFailedPrecondition, cur, req.Version)
		}
		version = req.Version
	}
	merged := files
	if !req.ReplaceAll {
		named, err := rules.Compile(version, files)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		replaced := make(map[string]bool, len(named.Domains()))
		for _, d := range named.Domains() {
			replaced[d] = true
		}
		merged = nil
		for _, f := range c.rules.Files() {
			if !replaced[f.Domain] {
				merged = append(merged, f)
			}
		}
		merged = append(merged, named.Files()...)
	}
	set, err := rules.Compile(version, merged)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if req.DryRun {
		return &allotv1.PutRulesResponse{Version: cur, Domains: append([]string(nil), set.Domains()...)}, nil
	}
	c.now = now
	c.setRules(set, now/1e6)
	if c.static != nil {
		c.staticTick(now)
	}
	if c.static != nil {
		c.hotAllTracked(now) // a rule may be eligible that was not
	}
	return &allotv1.PutRulesResponse{Version: version, Domains: append([]string(nil), set.Domains()...)}, nil
}

// setRules installs a compiled set and its wire Limit messages. The
// messages are shared by every response of one rules version: treat them as
// read-only.
func (c *core) setRules(set *rules.Set, updatedMs int64) {
	c.rules = set
	c.rulesUpdated = updatedMs
	rs := set.Rules()
	c.limitMsgs = make([]*allotv1.Limit, len(rs))
	for i, r := range rs {
		c.limitMsgs[i] = rulespb.Limit(r)
	}
}
