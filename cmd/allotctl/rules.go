package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (a *app) rulesCmd() *cobra.Command {
	var stale bool
	cmd := &cobra.Command{
		Use:   "rules",
		Short: "Show, validate, diff and apply the rule set",
		Long: `rules manages the cluster's rule set. Each rules file is in Envoy's
ratelimit YAML format (with allot's extensions, see docs/rules.md) and holds
exactly one domain. apply replaces only the domains of the files given; the
other domains stay.

Reads are linearizable: get and diff through any node show every apply that
returned before them (a follower forwards the read to the leader). --stale
reads the node's own replica instead, which may lag the leader.`,
		Example: `  allotctl rules get
  allotctl rules validate -f public-api.yaml
  allotctl rules diff -f public-api.yaml
  allotctl rules apply -f public-api.yaml -f internal.yaml`,
		RunE: groupRunE,
	}
	cmd.AddCommand(a.rulesGetCmd(&stale), a.rulesValidateCmd(), a.rulesDiffCmd(&stale), a.rulesApplyCmd())
	cmd.PersistentFlags().BoolVar(&stale, "stale", false, "get, diff: read the node's own replica (may lag the leader) instead of a linearizable read")
	return cmd
}

// ruleSetJSON is the -o json/yaml form of a RuleSet: like protojson, but
// with the YAML source as text rather than base64 bytes.
type ruleSetJSON struct {
	Version       uint64         `json:"version"`
	UpdatedUnixMS int64          `json:"updated_unix_ms"`
	Files         []ruleFileJSON `json:"files"`
}

type ruleFileJSON struct {
	Name   string `json:"name"`
	Domain string `json:"domain"`
	YAML   string `json:"yaml"`
}

func (a *app) rulesGetCmd(stale *bool) *cobra.Command {
	var domain string
	cmd := &cobra.Command{
		Use:   "get",
		Short: "Print the cluster's rules files",
		Long: `get prints the current rules files as one YAML stream (one document per
file, with the version and file names as comments). With --domain it prints
that domain's file exactly as stored, ready to edit and apply again.`,
		Example: `  allotctl rules get
  allotctl rules get --domain public-api > public-api.yaml
  allotctl rules get -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rs, err := a.getRules(cmd, *stale)
			if err != nil {
				return err
			}
			files := rs.GetFiles()
			if domain != "" {
				files = nil
				for _, f := range rs.GetFiles() {
					if f.GetDomain() == domain {
						files = append(files, f)
					}
				}
				if len(files) == 0 {
					return fmt.Errorf("no rules file for domain %q in rules version %d", domain, rs.GetVersion())
				}
			}
			if a.structured() {
				out := ruleSetJSON{Version: rs.GetVersion(), UpdatedUnixMS: rs.GetUpdatedUnixMs(), Files: []ruleFileJSON{}}
				for _, f := range files {
					out.Files = append(out.Files, ruleFileJSON{Name: f.GetName(), Domain: f.GetDomain(), YAML: string(f.GetYaml())})
				}
				return a.writeValue(out)
			}
			if domain != "" {
				_, err := a.stdout.Write(files[0].GetYaml())
				return err
			}
			fmt.Fprintf(a.stdout, "# allot rules version %d, updated %s, %d file(s)\n",
				rs.GetVersion(), fmtUnixMS(rs.GetUpdatedUnixMs()), len(files))
			for _, f := range files {
				fmt.Fprintf(a.stdout, "---\n# file: %s, domain: %s\n", f.GetName(), f.GetDomain())
				src := f.GetYaml()
				a.stdout.Write(src)
				if len(src) > 0 && src[len(src)-1] != '\n' {
					fmt.Fprintln(a.stdout)
				}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&domain, "domain", "", "print only this domain's file, verbatim")
	return cmd
}

// localFile is one rules file read from disk and validated.
type localFile struct {
	path   string
	domain string
	src    []byte
	rules  int
}

// loadLocal reads the files (a directory stands for its *.yaml and *.yml
// files) and compiles them with pkg/rules, alone and together (which
// catches a domain given twice). Errors name file:line.
func loadLocal(paths []string) ([]localFile, error) {
	if len(paths) == 0 {
		return nil, usagef("give at least one rules file with -f FILE")
	}
	files, err := rules.ReadFiles(paths...)
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no rules files (*.yaml, *.yml) in %s", strings.Join(paths, ", "))
	}
	out := make([]localFile, 0, len(files))
	for _, f := range files {
		set, err := rules.Compile(0, []rules.File{f})
		if err != nil {
			return nil, err
		}
		ds := set.Domains()
		if len(ds) != 1 {
			return nil, fmt.Errorf("%s: want exactly one domain per file, found %d", f.Name, len(ds))
		}
		out = append(out, localFile{path: f.Name, domain: ds[0], src: f.Source, rules: len(set.Rules())})
	}
	if _, err := rules.Compile(0, files); err != nil {
		return nil, err
	}
	return out, nil
}

func (a *app) rulesValidateCmd() *cobra.Command {
	var files []string
	cmd := &cobra.Command{
		Use:   "validate -f FILE [-f FILE...]",
		Short: "Check rules files locally (no allocator needed)",
		Long: `validate compiles the files with the same code the allocator and the agents
use (pkg/rules) and prints OK, or the first error as file:line: key: message
(exit code 1). It runs locally and contacts no allocator; the allocator
validates again on apply, together with the domains it already has.`,
		Example: `  allotctl rules validate -f public-api.yaml
  allotctl rules validate -f public-api.yaml -f internal.yaml -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			lfs, err := loadLocal(files)
			if err != nil {
				return err
			}
			if a.structured() {
				type fileJSON struct {
					File   string `json:"file"`
					Domain string `json:"domain"`
					Rules  int    `json:"rules"`
				}
				out := struct {
					OK    bool       `json:"ok"`
					Files []fileJSON `json:"files"`
				}{OK: true}
				for _, lf := range lfs {
					out.Files = append(out.Files, fileJSON{File: lf.path, Domain: lf.domain, Rules: lf.rules})
				}
				return a.writeValue(out)
			}
			for _, lf := range lfs {
				fmt.Fprintf(a.stdout, "OK  %s: domain %s, %d rule(s)\n", lf.path, lf.domain, lf.rules)
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVarP(&files, "file", "f", nil, "rules file, or a directory of *.yaml files (repeatable)")
	_ = cmd.MarkFlagRequired("file")
	_ = cmd.MarkFlagFilename("file", "yaml", "yml")
	return cmd
}

// ruleChange is one rule added, removed or changed by a diff.
type ruleChange struct {
	Op     string `json:"op"` // added|removed|changed
	Domain string `json:"domain"`
	Path   string `json:"path"`
	Before string `json:"before,omitempty"`
	After  string `json:"after,omitempty"`
}

type domainDiff struct {
	Domain  string       `json:"domain"`
	File    string       `json:"file"`
	New     bool         `json:"new_domain"`
	Diff    string       `json:"diff"`
	Changes []ruleChange `json:"changes"`
}

func (a *app) rulesDiffCmd(stale *bool) *cobra.Command {
	var files []string
	cmd := &cobra.Command{
		Use:   "diff -f FILE [-f FILE...]",
		Short: "Show what applying the files would change",
		Long: `diff reads the cluster's current rules and shows, for each file's domain, a
unified line diff of the stored YAML against the file, then a summary of the
rules added (+), removed (-) and changed (~) by rule path and limit. Both
sides are compiled with pkg/rules, so a formatting-only edit shows in the
line diff but not in the summary.

The exit code is that of diff(1) and git diff --exit-code: 0 when the files
match the cluster's rules, 1 when they differ, 2 on an error.`,
		Example: `  allotctl rules diff -f public-api.yaml
  allotctl rules diff -f public-api.yaml -f internal.yaml -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			differ, err := a.rulesDiff(cmd, files, *stale)
			switch {
			case err != nil:
				return &codeError{code: exitDiffError, err: err}
			case differ:
				return &codeError{code: exitDiffer}
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVarP(&files, "file", "f", nil, "rules file, or a directory of *.yaml files (repeatable)")
	_ = cmd.MarkFlagRequired("file")
	_ = cmd.MarkFlagFilename("file", "yaml", "yml")
	return cmd
}

// rulesDiff prints the diff of the files against the cluster's rules and
// reports whether they differ.
func (a *app) rulesDiff(cmd *cobra.Command, files []string, stale bool) (differ bool, err error) {
	lfs, err := loadLocal(files)
	if err != nil {
		return false, err
	}
	rs, err := a.getRules(cmd, stale)
	if err != nil {
		return false, err
	}
	diffs, err := diffRules(rs, lfs)
	if err != nil {
		return false, err
	}
	for _, d := range diffs {
		differ = differ || d.Diff != "" || d.New || len(d.Changes) > 0
	}
	if a.structured() {
		return differ, a.writeValue(struct {
			Version uint64       `json:"version"`
			Domains []domainDiff `json:"domains"`
		}{rs.GetVersion(), diffs})
	}
	return differ, a.printDiffs(rs.GetVersion(), diffs)
}

// getRules reads the cluster's rules: linearizable (every apply that
// returned before is in it) unless stale.
func (a *app) getRules(cmd *cobra.Command, stale bool) (*allotv1.RuleSet, error) {
	c, err := a.admin()
	if err != nil {
		return nil, err
	}
	ctx, cancel := a.rpcCtx(cmd.Context())
	defer cancel()
	rs, err := c.GetRules(ctx, &allotv1.GetRulesRequest{Linearizable: !stale})
	if err != nil {
		return nil, a.rpcErr("GetRules", err)
	}
	return rs, nil
}

// diffRules compares the stored rule set with the local files, per domain
// of the files.
func diffRules(rs *allotv1.RuleSet, lfs []localFile) ([]domainDiff, error) {
	cur := make(map[string]*allotv1.RuleFile)
	var curFiles []rules.File
	for _, f := range rs.GetFiles() {
		rf := rules.File{Name: f.GetName(), Domain: f.GetDomain(), Source: f.GetYaml()}
		curFiles = append(curFiles, rf)
		d := f.GetDomain()
		if d == "" {
			// Older servers may leave the domain out: take it from the YAML.
			s, err := rules.Compile(0, []rules.File{rf})
			if err == nil && len(s.Domains()) == 1 {
				d = s.Domains()[0]
			}
		}
		cur[d] = f
	}
	curSet, err := rules.Compile(rs.GetVersion(), curFiles)
	if err != nil {
		return nil, fmt.Errorf("the cluster's current rules (version %d) do not compile with this allotctl: %v", rs.GetVersion(), err)
	}
	out := make([]domainDiff, 0, len(lfs))
	for _, lf := range lfs {
		dd := domainDiff{Domain: lf.domain, File: lf.path, Changes: []ruleChange{}}
		var before []*rules.Rule
		oldSrc := ""
		if f, ok := cur[lf.domain]; ok {
			oldSrc = string(f.GetYaml())
			before = rulesOf(curSet, lf.domain)
		} else {
			dd.New = true
		}
		var b strings.Builder
		from := fmt.Sprintf("%s (rules version %d)", lf.domain, rs.GetVersion())
		if dd.New {
			from = lf.domain + " (not in the cluster)"
		}
		writeUnified(&b, from, lf.path, diffLines(splitLines(oldSrc), splitLines(string(lf.src))), 3)
		dd.Diff = b.String()
		newSet, err := rules.Compile(0, []rules.File{{Name: lf.path, Source: lf.src}})
		if err != nil {
			return nil, err
		}
		dd.Changes = compareRules(before, rulesOf(newSet, lf.domain))
		out = append(out, dd)
	}
	return out, nil
}

func rulesOf(s *rules.Set, domain string) []*rules.Rule {
	var out []*rules.Rule
	for _, r := range s.Rules() {
		if r.Domain == domain {
			out = append(out, r)
		}
	}
	return out
}

// compareRules matches rules by path and reports additions, removals and
// changes of any limit parameter, sorted by path.
func compareRules(before, after []*rules.Rule) []ruleChange {
	old := make(map[string]*rules.Rule, len(before))
	for _, r := range before {
		old[r.Path] = r
	}
	changes := []ruleChange{}
	seen := make(map[string]bool, len(after))
	for _, r := range after {
		seen[r.Path] = true
		o, ok := old[r.Path]
		switch {
		case !ok:
			changes = append(changes, ruleChange{Op: "added", Domain: r.Domain, Path: r.Path, After: describeRule(r)})
		case describeRule(o) != describeRule(r):
			changes = append(changes, ruleChange{Op: "changed", Domain: r.Domain, Path: r.Path,
				Before: describeRule(o), After: describeRule(r)})
		}
	}
	for _, r := range before {
		if !seen[r.Path] {
			changes = append(changes, ruleChange{Op: "removed", Domain: r.Domain, Path: r.Path, Before: describeRule(r)})
		}
	}
	sort.SliceStable(changes, func(i, j int) bool { return changes[i].Path < changes[j].Path })
	return changes
}

// describeRule renders every parameter of a rule that affects enforcement,
// defaults left out: "30/minute burst 10", "unlimited", "5/minute burst 5
// shadow name=key_override replaces=premium,free_search".
func describeRule(r *rules.Rule) string {
	var parts []string
	if r.Unlimited {
		parts = append(parts, "unlimited")
	} else {
		parts = append(parts, fmt.Sprintf("%d/%s burst %d", r.RequestsPerUnit, r.Unit, r.Burst))
		if r.Algorithm != bucket.TokenBucket {
			parts = append(parts, r.Algorithm.String())
		}
		if r.Backend != rules.BackendLease {
			parts = append(parts, "backend="+r.Backend.String())
		}
		if r.FailureMode != rules.FailOpen {
			parts = append(parts, "failure_mode="+r.FailureMode.String())
		}
		if r.Shards > 1 {
			parts = append(parts, "shards="+strconv.Itoa(r.Shards))
		}
		if r.Routing != rules.RoutingSpread {
			parts = append(parts, "routing="+r.Routing.String())
		}
	}
	if r.ShadowMode {
		parts = append(parts, "shadow")
	}
	if r.DetailedMetric {
		parts = append(parts, "detailed_metric")
	}
	if r.Name != "" && r.Name != r.Path {
		parts = append(parts, "name="+r.Name)
	}
	if len(r.Replaces) > 0 {
		parts = append(parts, "replaces="+strings.Join(r.Replaces, ","))
	}
	return strings.Join(parts, " ")
}

func (a *app) printDiffs(version uint64, diffs []domainDiff) error {
	for i, d := range diffs {
		if i > 0 {
			fmt.Fprintln(a.stdout)
		}
		switch {
		case d.Diff == "":
			fmt.Fprintf(a.stdout, "%s: no changes (rules version %d)\n", d.Domain, version)
			continue
		case d.New:
			fmt.Fprintf(a.stdout, "%s: new domain\n", d.Domain)
		}
		fmt.Fprint(a.stdout, d.Diff)
		var add, rem, chg int
		for _, c := range d.Changes {
			switch c.Op {
			case "added":
				add++
			case "removed":
				rem++
			default:
				chg++
			}
		}
		fmt.Fprintf(a.stdout, "%s: %d rule(s) added, %d removed, %d changed\n", d.Domain, add, rem, chg)
		t := newTable(&indent{w: a.stdout, prefix: "  "})
		for _, c := range d.Changes {
			switch c.Op {
			case "added":
				t.row("+", c.Path, c.After)
			case "removed":
				t.row("-", c.Path, c.Before)
			default:
				t.row("~", c.Path, c.Before+"  ->  "+c.After)
			}
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	return nil
}

func (a *app) rulesApplyCmd() *cobra.Command {
	var (
		files  []string
		dryRun bool
		wait   time.Duration
	)
	cmd := &cobra.Command{
		Use:   "apply -f FILE [-f FILE...]",
		Short: "Validate locally, then replace the files' domains in the cluster",
		Long: `apply validates the files locally (as validate does), reads the current
rules version, and sends the files to the allocator, replacing only their
domains (other domains stay). The put is conditional on that version: if
someone else changed the rules in between, nothing changes and apply fails;
review with 'allotctl rules diff' and apply again. The allocator validates the
resulting set too and rejects it whole on any error (file:line). Agents pick
up the new version within a moment. --dry-run has the allocator validate
without changing anything.

apply waits up to --wait (default 1m, not --timeout) for the allocator to
answer: a large rule set takes a while to send, compile and commit. If no
answer comes in time, apply reads the rules back: it reports the new version
when the commit is there, and otherwise says that the put is not confirmed
(it may still commit; 'allotctl rules get' shows the version) and exits 1.`,
		Example: `  allotctl rules apply -f public-api.yaml
  allotctl rules apply -f public-api.yaml -f internal.yaml --dry-run`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			lfs, err := loadLocal(files)
			if err != nil {
				return err
			}
			// The version the put is conditional on: linearizable, so an
			// apply right after another through a follower does not fail.
			rs, err := a.getRules(cmd, false)
			if err != nil {
				return err
			}
			req := &allotv1.PutRulesRequest{ExpectedVersion: rs.GetVersion(), DryRun: dryRun}
			var names []string
			for _, lf := range lfs {
				req.Files = append(req.Files, &allotv1.RuleFile{Name: filepath.Base(lf.path), Domain: lf.domain, Yaml: lf.src})
				names = append(names, lf.domain)
			}
			c, _ := a.admin()
			ctx, cancel := context.WithTimeout(cmd.Context(), max(wait, a.timeout))
			defer cancel()
			resp, err := c.PutRules(ctx, req)
			if err != nil && !dryRun && outcomeUnknown(err) {
				if v, ok := a.confirmPut(cmd, req); ok {
					resp, err = &allotv1.PutRulesResponse{Version: v}, nil
				} else {
					why := a.rpcErr("PutRules", err)
					if errors.Is(ctx.Err(), context.DeadlineExceeded) && wait > a.timeout {
						why = fmt.Errorf("allocator at %s did not answer within %s (--wait)", a.addr, wait)
					}
					return fmt.Errorf("the put of domain(s) %s (expecting version %d) is not confirmed: %v; it may still "+
						"commit: check with 'allotctl rules get'", strings.Join(names, ", "), rs.GetVersion(), why)
				}
			}
			if err != nil {
				if st, ok := status.FromError(err); ok && st.Code() == codes.FailedPrecondition {
					return errors.Join(a.rpcErr("PutRules", err), fmt.Errorf(
						"the rules changed since version %d was read: review with 'allotctl rules diff' and apply again", rs.GetVersion()))
				}
				return a.rpcErr("PutRules", err)
			}
			if a.structured() {
				return a.writeProto(resp)
			}
			if dryRun {
				_, err = fmt.Fprintf(a.stdout, "Dry run: the allocator accepts domain(s) %s; rules stay at version %d.\n",
					strings.Join(names, ", "), resp.GetVersion())
				return err
			}
			_, err = fmt.Fprintf(a.stdout, "Applied domain(s) %s: rules version %d -> %d.\n",
				strings.Join(names, ", "), rs.GetVersion(), resp.GetVersion())
			return err
		},
	}
	f := cmd.Flags()
	f.StringArrayVarP(&files, "file", "f", nil, "rules file, or a directory of *.yaml files (repeatable)")
	f.BoolVar(&dryRun, "dry-run", false, "have the allocator validate, change nothing")
	f.DurationVar(&wait, "wait", time.Minute, "how long to wait for the allocator to commit the put (then the rules are read back)")
	_ = cmd.MarkFlagRequired("file")
	_ = cmd.MarkFlagFilename("file", "yaml", "yml")
	return cmd
}

// outcomeUnknown reports whether a failed put may still have been (or be)
// committed: the call ended without an answer from the allocator.
func outcomeUnknown(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	switch status.Code(err) {
	case codes.DeadlineExceeded, codes.Unavailable, codes.Unknown:
		return true
	}
	return false
}

// confirmPut reads the rules back from the leader (linearizable; for up to
// 10 s, each read bounded by --timeout) and reports the version if the cluster moved past
// req.ExpectedVersion with req's files in place: the put committed.
func (a *app) confirmPut(cmd *cobra.Command, req *allotv1.PutRulesRequest) (uint64, bool) {
	c, err := a.admin()
	if err != nil {
		return 0, false
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := a.rpcCtx(cmd.Context())
		rs, err := c.GetRules(ctx, &allotv1.GetRulesRequest{Linearizable: true})
		cancel()
		if err == nil && rs.GetVersion() > req.GetExpectedVersion() {
			return rs.GetVersion(), holdsFiles(rs, req.GetFiles())
		}
		if time.Now().After(deadline) || cmd.Context().Err() != nil {
			return 0, false
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// holdsFiles reports whether rs carries every file of want (same domain,
// same YAML).
func holdsFiles(rs *allotv1.RuleSet, want []*allotv1.RuleFile) bool {
	have := make(map[string][]byte, len(rs.GetFiles()))
	for _, f := range rs.GetFiles() {
		have[f.GetDomain()+"\x00"+f.GetName()] = f.GetYaml()
	}
	for _, f := range want {
		if y, ok := have[f.GetDomain()+"\x00"+f.GetName()]; !ok || !bytes.Equal(y, f.GetYaml()) {
			return false
		}
	}
	return true
}
