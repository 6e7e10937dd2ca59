package rules

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/allot/allot/pkg/bucket"
)

// Limits on what one rules file may contain. They bound the work a hostile or
// broken file (for example a YAML alias bomb) can cause.
const (
	// MaxDepth is the deepest descriptor nesting accepted.
	MaxDepth = 32
	// maxNodes bounds the YAML nodes visited per file, aliases expanded.
	maxNodes = 1 << 20
	// maxMergeDepth bounds a chain of merge keys (<<) whose mappings merge
	// further mappings.
	maxMergeDepth = 32
	// MaxBurst bounds burst, matching the allocator's 1e12 bound on token
	// counts.
	MaxBurst = 1_000_000_000_000
	// MaxKeyBytes bounds a rule's descriptor: its domain plus, per level,
	// the key, the value and 2 bytes of separators. It is the protocol's
	// bound on a key (allotv1.MaxKeyBytes): the agent refuses a longer
	// descriptor, so a longer rule could never match.
	MaxKeyBytes = 4096
	// MaxShards bounds shards.
	MaxShards = 1024
	// MaxWindow bounds unit × unit_multiplier (bucket.MaxWindow, about 36
	// years).
	MaxWindow = bucket.MaxWindow
)

// Keys accepted at each level. Envoy's loader checks one flat list of keys
// at every level; allot checks each level's own list, so a key in the wrong
// place (a common mistake Envoy silently ignores) is reported.
var (
	rootKeys = []string{"domain", "descriptors", "scope", "global_fallback", "static_fraction"}
	descKeys = []string{"key", "value", "rate_limit", "descriptors", "shadow_mode",
		"detailed_metric", "value_to_metric", "share_threshold", "quota_mode", "metadata"}
	limitKeys = []string{"unit", "requests_per_unit", "unlimited", "name", "replaces", "unit_multiplier",
		// allot's extensions
		"burst", "algorithm", "backend", "failure_mode", "shards", "routing",
		"scope", "global_fallback", "static_fraction"}
	replacesKeys = []string{"name"}
	// extension keys a user may try to put beside rate_limit.
	extensionKeys = []string{"burst", "algorithm", "backend", "failure_mode", "shards", "routing",
		"scope", "global_fallback", "static_fraction"}
)

// Compile parses and validates every file and builds the matcher. Any error
// rejects the whole set: the result is a *Error naming the file, line and
// key. Each file holds one domain; a domain may appear in one file only.
// Files' Domain fields may be empty on input and are filled from the YAML;
// when given, they must agree with it.
func Compile(version uint64, files []File) (*Set, error) {
	s := &Set{
		version: version,
		domains: make(map[string]*domainTree, len(files)),
		files:   make([]File, 0, len(files)),
		nameIDs: map[string]int32{},
	}
	domainFile := map[string]string{}
	for _, f := range files {
		c := newCompiler(s, f.Name)
		domain, line, tree, err := c.compileFile(f.Source)
		if err != nil {
			return nil, err
		}
		if f.Domain != "" && f.Domain != domain {
			return nil, &Error{File: f.Name, Line: line, Key: "domain",
				Msg: fmt.Sprintf("domain '%s' does not match the file's declared domain '%s'", domain, f.Domain)}
		}
		if prev, dup := domainFile[domain]; dup {
			return nil, &Error{File: f.Name, Line: line, Key: "domain",
				Msg: fmt.Sprintf("duplicate domain '%s' in config file (already in %s)", domain, prev)}
		}
		domainFile[domain] = f.Name
		s.domains[domain] = tree
		s.domainNames = append(s.domainNames, domain)
		f.Domain = domain
		f.Source = bytes.Clone(f.Source)
		s.files = append(s.files, f)
		s.warnings = append(s.warnings, c.warnings...)
	}
	sort.Strings(s.domainNames)
	s.resolveReplaces()
	return s, nil
}

// compiler holds the state of compiling one file.
type compiler struct {
	set      *Set
	file     string
	domain   string
	budget   int                // YAML nodes left to visit
	merging  []*yaml.Node       // the mappings being read, outermost first: a merge chain
	wilds    map[wildValue]bool // the wildcard values of each key group, for the duplicate check
	warnings []string           // non-fatal findings
	rules    []*Rule            // this file's rules, for the replaces check
	scope    scoping            // the domain's scope fields, the rules' defaults
}

func newCompiler(set *Set, file string) *compiler {
	return &compiler{set: set, file: file, budget: maxNodes, wilds: map[wildValue]bool{}}
}

func (c *compiler) errf(n *yaml.Node, key, format string, args ...any) *Error {
	line := 0
	if n != nil {
		line = n.Line
	}
	return &Error{File: c.file, Line: line, Key: key, Msg: fmt.Sprintf(format, args...)}
}

// compileFile parses one file and returns its domain, the line of the
// domain key, and its tree.
func (c *compiler) compileFile(src []byte) (string, int, *domainTree, error) {
	dec := yaml.NewDecoder(bytes.NewReader(src))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return "", 0, nil, c.yamlError(err)
	}
	// Further documents must be empty: a second domain belongs in its own
	// file.
	for {
		var extra yaml.Node
		err := dec.Decode(&extra)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", 0, nil, c.yamlError(err)
		}
		if len(extra.Content) > 0 && extra.Content[0].ShortTag() != "!!null" {
			return "", 0, nil, c.errf(&extra, "", "config error, more than one YAML document in one file (one file holds one domain)")
		}
	}
	var root *yaml.Node
	if doc.Kind == yaml.DocumentNode && len(doc.Content) > 0 {
		root = c.resolve(doc.Content[0])
	}
	if root == nil || root.ShortTag() == "!!null" {
		return "", 1, nil, &Error{File: c.file, Line: 1, Key: "domain", Msg: "config file cannot have empty domain"}
	}
	if root.Kind != yaml.MappingNode {
		return "", 0, nil, c.errf(root, "", "config error, the top level must be a mapping with domain and descriptors")
	}
	fields, err := c.mapping(root, rootKeys, "")
	if err != nil {
		return "", 0, nil, err
	}
	domainLine := root.Line
	var domain string
	if kv, ok := fields["domain"]; ok {
		domainLine = kv.key.Line
		if domain, err = c.str(kv); err != nil {
			return "", 0, nil, err
		}
	}
	if domain == "" {
		return "", 0, nil, &Error{File: c.file, Line: domainLine, Key: "domain", Msg: "config file cannot have empty domain"}
	}
	if !ValidText(domain) {
		return "", 0, nil, &Error{File: c.file, Line: domainLine, Key: "domain", Msg: "the domain " + notText}
	}
	c.domain = domain
	if c.scope, err = c.scoping(fields, scoping{}); err != nil {
		return "", 0, nil, err
	}
	if err := c.checkScoping(c.scope); err != nil {
		return "", 0, nil, err
	}
	tree := &domainTree{}
	if kv, ok := fields["descriptors"]; ok {
		tree.root, err = c.descriptors(kv, nil, 1)
		if err != nil {
			return "", 0, nil, err
		}
	}
	if err := c.checkReplaces(); err != nil {
		return "", 0, nil, err
	}
	return domain, domainLine, tree, nil
}

// yamlError turns a yaml.v3 syntax or type error into an *Error, keeping the
// line number yaml reports ("yaml: line 3: …").
func (c *compiler) yamlError(err error) *Error {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	line := 0
	if rest, ok := strings.CutPrefix(msg, "line "); ok {
		if i := strings.IndexByte(rest, ':'); i > 0 {
			if n, err := strconv.Atoi(rest[:i]); err == nil {
				line = n
				msg = strings.TrimSpace(rest[i+1:])
			}
		}
	}
	return &Error{File: c.file, Line: line, Msg: "error loading config file: " + msg}
}

// resolve follows aliases and charges the node budget. It returns nil when
// the budget is spent or an alias is dangling; callers report that.
func (c *compiler) resolve(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	c.budget--
	if c.budget < 0 {
		return nil
	}
	return n
}

// wildValue is a wildcard value in a key group.
type wildValue struct {
	g     *keyGroup
	value string
}

// field is one key/value pair of a mapping.
type field struct {
	name     string
	key, val *yaml.Node // val resolved (aliases followed)
}

// mapping checks a mapping's keys against allowed and returns its fields by
// name. Merge keys (<<) are honoured: explicit keys win over merged ones.
func (c *compiler) mapping(n *yaml.Node, allowed []string, where string) (map[string]field, error) {
	c.merging = append(c.merging, n)
	defer func() { c.merging = c.merging[:len(c.merging)-1] }()
	out := make(map[string]field, len(n.Content)/2)
	var merged []field
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := c.resolve(n.Content[i])
		v := c.resolve(n.Content[i+1])
		if k == nil || v == nil {
			return nil, c.errf(n, "", "config error, document too large or has a dangling alias")
		}
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			m, err := c.mergeFields(k, v, allowed, where)
			if err != nil {
				return nil, err
			}
			merged = append(merged, m...)
			continue
		}
		if k.Kind != yaml.ScalarNode || k.ShortTag() != "!!str" {
			return nil, c.errf(k, "", "config error, key is not of type string: %s", nodeText(k))
		}
		if !contains(allowed, k.Value) {
			hint := ""
			if where == "descriptor" && contains(extensionKeys, k.Value) {
				hint = " (allot's extensions go inside rate_limit)"
			}
			return nil, c.errf(k, k.Value, "config error, unknown key '%s'%s", k.Value, hint)
		}
		if _, dup := out[k.Value]; dup {
			return nil, c.errf(k, k.Value, "config error, key '%s' is defined twice in one mapping", k.Value)
		}
		out[k.Value] = field{name: k.Value, key: k, val: v}
	}
	for _, f := range merged {
		if _, ok := out[f.name]; !ok {
			out[f.name] = f
		}
	}
	return out, nil
}

// mergeFields reads the mappings that the merge key k names (v, resolved).
// A mapping that is being read already (it merges itself, directly or
// through others) is a cycle, refused, as is a chain of merges deeper than
// maxMergeDepth.
func (c *compiler) mergeFields(k, v *yaml.Node, allowed []string, where string) ([]field, error) {
	var srcs []*yaml.Node
	switch v.Kind {
	case yaml.MappingNode:
		srcs = []*yaml.Node{v}
	case yaml.SequenceNode:
		for _, e := range v.Content {
			e = c.resolve(e)
			if e == nil || e.Kind != yaml.MappingNode {
				return nil, c.errf(v, "<<", "config error, a merge key needs a mapping or a list of mappings")
			}
			srcs = append(srcs, e)
		}
	default:
		return nil, c.errf(v, "<<", "config error, a merge key needs a mapping or a list of mappings")
	}
	if len(c.merging) >= maxMergeDepth {
		return nil, c.errf(k, "<<", "config error, merge keys nested deeper than %d levels", maxMergeDepth)
	}
	var out []field
	for _, m := range srcs {
		if slices.Contains(c.merging, m) {
			return nil, c.errf(k, "<<", "config error, a merge key refers to a mapping that contains it (a cycle)")
		}
		fs, err := c.mapping(m, allowed, where)
		if err != nil {
			return nil, err
		}
		for _, f := range fs {
			out = append(out, f)
		}
	}
	// Map iteration order is random; make "first merged source wins"
	// deterministic by sorting on position.
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i].key, out[j].key
		return a.Line < b.Line || (a.Line == b.Line && a.Column < b.Column)
	})
	return out, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// nodeText renders a node for an error message.
func nodeText(n *yaml.Node) string {
	switch n.Kind {
	case yaml.ScalarNode:
		if n.Style&(yaml.DoubleQuotedStyle|yaml.SingleQuotedStyle) != 0 {
			return strconv.Quote(n.Value)
		}
		return n.Value
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return "an unsupported node"
}

// str reads a string field. Like Envoy's YAML loader, any scalar is taken as
// its text (value: 200 is the string "200"); null is "".
func (c *compiler) str(f field) (string, error) {
	if f.val.Kind != yaml.ScalarNode {
		return "", c.errf(f.val, f.name, "must be a string, not %s", nodeText(f.val))
	}
	if f.val.ShortTag() == "!!null" {
		return "", nil
	}
	return f.val.Value, nil
}

// yaml11Bools are the YAML 1.1 boolean spellings that Envoy's yaml.v2 loader
// accepts and yaml.v3 reads as strings.
var yaml11Bools = map[string]bool{
	"y": true, "Y": true, "yes": true, "Yes": true, "YES": true, "on": true, "On": true, "ON": true,
	"n": false, "N": false, "no": false, "No": false, "NO": false, "off": false, "Off": false, "OFF": false,
}

func (c *compiler) boolean(f field) (bool, error) {
	v := f.val
	if v.Kind == yaml.ScalarNode {
		switch v.ShortTag() {
		case "!!null":
			return false, nil
		case "!!bool":
			var b bool
			if err := v.Decode(&b); err == nil {
				return b, nil
			}
		case "!!str":
			if v.Style == 0 { // plain, unquoted
				if b, ok := yaml11Bools[v.Value]; ok {
					return b, nil
				}
			}
		}
	}
	return false, c.errf(v, f.name, "must be true or false, not %s", nodeText(v))
}

// integer reads an integer field. Integral floats (10.0) are accepted as
// Envoy's loader does; null is 0.
func (c *compiler) integer(f field) (int64, error) {
	v := f.val
	if v.Kind == yaml.ScalarNode {
		switch v.ShortTag() {
		case "!!null":
			return 0, nil
		case "!!int":
			var i int64
			if err := v.Decode(&i); err == nil {
				return i, nil
			}
			return 0, c.errf(v, f.name, "integer %s out of range", v.Value)
		case "!!float":
			var x float64
			if err := v.Decode(&x); err == nil && x == math.Trunc(x) && math.Abs(x) < 1<<62 {
				return int64(x), nil
			}
		}
	}
	return 0, c.errf(v, f.name, "must be an integer, not %s", nodeText(v))
}

// descriptors compiles a descriptor list at depth (1-based) below parent
// (nil at the root) and returns the level's key groups.
func (c *compiler) descriptors(f field, parent []level, depth int) (map[string]*keyGroup, error) {
	v := f.val
	if v.ShortTag() == "!!null" {
		return nil, nil
	}
	if v.Kind != yaml.SequenceNode {
		return nil, c.errf(v, f.name, "config error, descriptors must be a list of mappings, not %s", nodeText(v))
	}
	if depth > MaxDepth {
		return nil, c.errf(v, f.name, "config error, descriptors nested deeper than %d levels", MaxDepth)
	}
	groups := map[string]*keyGroup{}
	for _, e := range v.Content {
		d := c.resolve(e)
		if d == nil {
			return nil, c.errf(v, f.name, "config error, document too large or has a dangling alias")
		}
		if d.Kind != yaml.MappingNode {
			return nil, c.errf(d, f.name, "config error, yaml file contains list of type other than map: %s", nodeText(d))
		}
		if err := c.descriptor(d, parent, depth, groups); err != nil {
			return nil, err
		}
	}
	if len(groups) == 0 {
		return nil, nil
	}
	return groups, nil
}

// descriptor compiles one descriptor mapping into groups.
func (c *compiler) descriptor(d *yaml.Node, parent []level, depth int, groups map[string]*keyGroup) error {
	fs, err := c.mapping(d, descKeys, "descriptor")
	if err != nil {
		return err
	}
	var key, value string
	keyNode := d
	if kv, ok := fs["key"]; ok {
		keyNode = kv.key
		if key, err = c.str(kv); err != nil {
			return err
		}
	}
	if key == "" {
		return c.errf(keyNode, "key", "descriptor has empty key")
	}
	if kv, ok := fs["value"]; ok {
		if value, err = c.str(kv); err != nil {
			return err
		}
	}
	if !ValidText(key) {
		return c.errf(keyNode, "key", "the key %s", notText)
	}
	if !ValidText(value) {
		return c.errf(fs["value"].key, "value", "the value %s", notText)
	}
	flags := map[string]bool{}
	for _, name := range []string{"shadow_mode", "detailed_metric", "value_to_metric", "share_threshold", "quota_mode"} {
		if kv, ok := fs[name]; ok {
			b, err := c.boolean(kv)
			if err != nil {
				return err
			}
			flags[name] = b
		}
	}
	if kv, ok := fs["metadata"]; ok {
		// Envoy sends metadata to the client; allot accepts it and ignores it.
		if kv.val.Kind != yaml.MappingNode && kv.val.ShortTag() != "!!null" {
			return c.errf(kv.val, "metadata", "must be a mapping, not %s", nodeText(kv.val))
		}
	}

	lv := level{key: key, value: value, kind: matchKeyOnly}
	switch {
	case value == "":
	case strings.Contains(value, "*"):
		lv.kind = matchWildcard
		lv.share = flags["share_threshold"]
	default:
		lv.kind = matchExact
	}
	if flags["share_threshold"] && lv.kind != matchWildcard {
		c.warnings = append(c.warnings, fmt.Sprintf("%s:%d: share_threshold has no effect on a descriptor without a wildcard value", c.file, d.Line))
	}
	path := append(append([]level(nil), parent...), lv)
	if size := keyBytes(c.domain, path); size > MaxKeyBytes {
		return c.errf(keyNode, "key", "the descriptor takes %d bytes (domain, keys and values, 2 per entry), at most %d", size, MaxKeyBytes)
	}

	g := groups[key]
	if g == nil {
		g = &keyGroup{}
		groups[key] = g
	}
	n := &node{lvl: lv}
	dupKey := "key"
	switch lv.kind {
	case matchKeyOnly:
		if g.keyOnly != nil {
			return c.errf(keyNode, dupKey, "duplicate descriptor composite key '%s'", c.compositeKey(path))
		}
		g.keyOnly = n
	case matchExact:
		if g.exact == nil {
			g.exact = map[string]*node{}
		}
		if g.exact[value] != nil {
			return c.errf(fs["value"].key, "value", "duplicate descriptor composite key '%s'", c.compositeKey(path))
		}
		g.exact[value] = n
	case matchWildcard:
		if c.wilds[wildValue{g, value}] {
			return c.errf(fs["value"].key, "value", "duplicate descriptor composite key '%s'", c.compositeKey(path))
		}
		c.wilds[wildValue{g, value}] = true
		n.w = compileWildcard(value)
		g.wild = append(g.wild, n)
	}

	if kv, ok := fs["rate_limit"]; ok && kv.val.ShortTag() != "!!null" {
		r, err := c.rateLimit(kv, path, flags)
		if err != nil {
			return err
		}
		r.Line = keyNode.Line
		n.rule = r
	} else if flags["shadow_mode"] || flags["quota_mode"] {
		// Harmless, as in Envoy, but worth a note.
		c.warnings = append(c.warnings, fmt.Sprintf("%s:%d: shadow_mode/quota_mode on a descriptor without rate_limit has no effect", c.file, d.Line))
	}
	if kv, ok := fs["descriptors"]; ok {
		n.children, err = c.descriptors(kv, path, depth+1)
		if err != nil {
			return err
		}
	}
	return nil
}

// notText completes an error about text a descriptor cannot carry.
const notText = "is not valid text (invalid UTF-8 or control characters): a request could never carry it"

// keyBytes is the size of a descriptor of domain and path as the agent
// counts it against MaxKeyBytes.
func keyBytes(domain string, path []level) int {
	n := len(domain)
	for _, l := range path {
		n += len(l.key) + len(l.value) + 2
	}
	return n
}

// compositeKey renders a path the way Envoy's error messages do:
// "domain.key_value.key".
func (c *compiler) compositeKey(path []level) string {
	var b strings.Builder
	b.WriteString(c.domain)
	for _, l := range path {
		b.WriteByte('.')
		b.WriteString(l.key)
		if l.value != "" {
			b.WriteByte('_')
			b.WriteString(l.value)
		}
	}
	return b.String()
}

// rulePath renders "k1=v1/k2/k3=v3".
func rulePath(path []level) string {
	var b strings.Builder
	for i, l := range path {
		if i > 0 {
			b.WriteByte('/')
		}
		b.WriteString(l.key)
		if l.value != "" {
			b.WriteByte('=')
			b.WriteString(l.value)
		}
	}
	return b.String()
}

// rateLimit compiles a rate_limit block into a Rule and registers it.
func (c *compiler) rateLimit(f field, path []level, flags map[string]bool) (*Rule, error) {
	if f.val.Kind != yaml.MappingNode {
		return nil, c.errf(f.val, "rate_limit", "must be a mapping, not %s", nodeText(f.val))
	}
	fs, err := c.mapping(f.val, limitKeys, "rate_limit")
	if err != nil {
		return nil, err
	}
	r := &Rule{
		Domain:         c.domain,
		Path:           rulePath(path),
		Depth:          len(path),
		ShadowMode:     flags["shadow_mode"] || flags["quota_mode"],
		QuotaMode:      flags["quota_mode"],
		DetailedMetric: flags["detailed_metric"],
		ValueToMetric:  flags["value_to_metric"],
		UnitMultiplier: 1,
		Shards:         1,
		File:           c.file,
		levels:         path,
		nameID:         -1,
	}
	for _, l := range path {
		if l.share {
			r.ShareThreshold = true
		}
	}
	if kv, ok := fs["unlimited"]; ok {
		if r.Unlimited, err = c.boolean(kv); err != nil {
			return nil, err
		}
	}
	if kv, ok := fs["name"]; ok {
		if r.Name, err = c.str(kv); err != nil {
			return nil, err
		}
		r.HasName = r.Name != ""
	}
	if !r.HasName {
		r.Name = r.Path
	}
	if kv, ok := fs["replaces"]; ok {
		if err := c.replaces(kv, r); err != nil {
			return nil, err
		}
	}

	sc, err := c.scoping(fs, c.scope)
	if err != nil {
		return nil, err
	}

	var unitText string
	unitField, hasUnit := fs["unit"]
	if hasUnit {
		if unitText, err = c.str(unitField); err != nil {
			return nil, err
		}
	}
	if r.Unlimited {
		// requests_per_unit is ignored with unlimited, as in Envoy, but it
		// must still be a number.
		if kv, ok := fs["requests_per_unit"]; ok {
			if _, err := c.integer(kv); err != nil {
				return nil, err
			}
		}
		if u, err := ParseUnit(unitText); err == nil && u != UnitUnknown {
			return nil, c.errf(unitField.key, "unit", "should not specify rate limit unit when unlimited")
		}
		for _, k := range append([]string{"unit_multiplier"}, extensionKeys...) {
			if kv, ok := fs[k]; ok {
				return nil, c.errf(kv.key, k, "should not specify %s when unlimited", k)
			}
		}
		c.register(r)
		return r, nil
	}

	line := f.key
	if hasUnit {
		line = unitField.key
	}
	u, err := ParseUnit(unitText)
	if err != nil {
		return nil, c.errf(line, "unit", "invalid rate limit unit '%s'", unitText)
	}
	r.Unit = u

	if kv, ok := fs["unit_multiplier"]; ok {
		m, err := c.integer(kv)
		if err != nil {
			return nil, err
		}
		if m < 1 || m > math.MaxUint32 {
			return nil, c.errf(kv.key, "unit_multiplier", "unit_multiplier must be ≥ 1, got %d", m)
		}
		r.UnitMultiplier = uint32(m)
	}
	if int64(r.UnitMultiplier) > int64(MaxWindow/u.Duration()) {
		return nil, c.errf(line, "unit_multiplier", "window of %d × %s is longer than the longest supported window (%v)", r.UnitMultiplier, u, MaxWindow)
	}
	r.Window = u.Duration() * time.Duration(r.UnitMultiplier)

	rpuField, ok := fs["requests_per_unit"]
	if !ok {
		return nil, c.errf(f.key, "requests_per_unit", "requests_per_unit is required unless unlimited is true")
	}
	rpu, err := c.integer(rpuField)
	if err != nil {
		return nil, err
	}
	if rpu < 0 || rpu > math.MaxUint32 {
		return nil, c.errf(rpuField.key, "requests_per_unit",
			"requests_per_unit must be between 0 and %d, got %d", uint32(math.MaxUint32), rpu)
	}
	r.RequestsPerUnit = uint32(rpu)
	if rpu == 0 {
		// Envoy's way to block a key: every request is over the limit.
		for _, k := range []string{"burst", "algorithm", "shards"} {
			if kv, ok := fs[k]; ok {
				return nil, c.errf(kv.key, k, "should not specify %s when requests_per_unit is 0 (the key is blocked)", k)
			}
		}
		if r.Limit, err = bucket.DenyAll(r.Window); err != nil {
			return nil, c.errf(line, "unit", "%s", strings.TrimPrefix(err.Error(), "bucket: invalid limit: "))
		}
		r.DenyAll = true
		if err := c.applyScoping(r, sc, fs); err != nil {
			return nil, err
		}
		c.register(r)
		return r, nil
	}

	r.Burst = rpu
	if kv, ok := fs["burst"]; ok {
		b, err := c.integer(kv)
		if err != nil {
			return nil, err
		}
		if b < 1 || b > MaxBurst {
			return nil, c.errf(kv.key, "burst", "burst must be between 1 and %d, got %d", int64(MaxBurst), b)
		}
		r.Burst = b
	}
	if kv, ok := fs["algorithm"]; ok {
		s, err := c.str(kv)
		if err != nil {
			return nil, err
		}
		if r.Algorithm, err = bucket.ParseAlgorithm(strings.ToLower(s)); err != nil {
			return nil, c.errf(kv.val, "algorithm", "unknown algorithm '%s' (want token_bucket, gcra, sliding_window or fixed_window)", s)
		}
	}
	if kv, ok := fs["backend"]; ok {
		s, err := c.str(kv)
		if err != nil {
			return nil, err
		}
		if r.Backend, err = ParseBackend(s); err != nil {
			return nil, c.errf(kv.val, "backend", "unknown backend '%s' (want lease, redis or local)", s)
		}
	}
	if kv, ok := fs["failure_mode"]; ok {
		s, err := c.str(kv)
		if err != nil {
			return nil, err
		}
		if r.FailureMode, err = ParseFailureMode(s); err != nil {
			return nil, c.errf(kv.val, "failure_mode", "unknown failure_mode '%s' (want open or closed)", s)
		}
	}
	if kv, ok := fs["routing"]; ok {
		s, err := c.str(kv)
		if err != nil {
			return nil, err
		}
		if r.Routing, err = ParseRouting(s); err != nil {
			return nil, c.errf(kv.val, "routing", "unknown routing '%s' (want spread or consistent_hash)", s)
		}
	}
	if kv, ok := fs["shards"]; ok {
		n, err := c.integer(kv)
		if err != nil {
			return nil, err
		}
		if n < 1 || n > MaxShards {
			return nil, c.errf(kv.key, "shards", "shards must be between 1 and %d, got %d", MaxShards, n)
		}
		r.Shards = int(n)
	}

	if kv, ok := fs["burst"]; ok && (r.Algorithm == bucket.SlidingWindow || r.Algorithm == bucket.FixedWindow) && r.Burst != rpu {
		return nil, c.errf(kv.key, "burst", "burst applies to token_bucket and gcra only; with %s a window's capacity is requests_per_unit (%d), got burst %d", r.Algorithm, rpu, r.Burst)
	}

	lim, err := bucket.NewLimit(r.Algorithm, int64(r.RequestsPerUnit), r.Window, r.Burst)
	if err != nil {
		key, at := "rate_limit", f.key
		if kv, ok := fs["burst"]; ok {
			key, at = "burst", kv.key
		}
		return nil, c.errf(at, key, "%s", strings.TrimPrefix(err.Error(), "bucket: invalid limit: "))
	}
	r.Limit = lim
	if err := c.applyScoping(r, sc, fs); err != nil {
		return nil, err
	}
	c.register(r)
	return r, nil
}

func (c *compiler) replaces(f field, r *Rule) error {
	v := f.val
	if v.ShortTag() == "!!null" {
		return nil
	}
	if v.Kind != yaml.SequenceNode {
		return c.errf(v, "replaces", "replaces must be a list of {name: ...}, not %s", nodeText(v))
	}
	for _, e := range v.Content {
		e = c.resolve(e)
		if e == nil {
			return c.errf(v, "replaces", "config error, document too large or has a dangling alias")
		}
		if e.Kind != yaml.MappingNode {
			return c.errf(e, "replaces", "config error, yaml file contains list of type other than map: %s", nodeText(e))
		}
		fs, err := c.mapping(e, replacesKeys, "replaces")
		if err != nil {
			return err
		}
		var name string
		if kv, ok := fs["name"]; ok {
			if name, err = c.str(kv); err != nil {
				return err
			}
		}
		if name == "" {
			return c.errf(e, "replaces", "should not have an empty replaces entry")
		}
		if r.HasName && name == r.Name {
			return c.errf(e, "replaces", "replaces should not contain name of same descriptor")
		}
		r.Replaces = append(r.Replaces, name)
	}
	return nil
}

// register gives r its ID in the set.
func (c *compiler) register(r *Rule) {
	r.ID = len(c.set.rules)
	c.set.rules = append(c.set.rules, r)
	c.rules = append(c.rules, r)
}

// checkReplaces warns about replaces naming no limit of the same domain:
// Envoy accepts them (they can never match, because one request carries one
// domain), so allot accepts them too.
func (c *compiler) checkReplaces() error {
	names := map[string]bool{}
	for _, r := range c.rules {
		if r.HasName {
			names[r.Name] = true
		}
	}
	for _, r := range c.rules {
		for _, n := range r.Replaces {
			if !names[n] {
				c.warnings = append(c.warnings, fmt.Sprintf("%s:%d: replaces names '%s', which no rate_limit in domain '%s' has", c.file, r.Line, n, c.domain))
			}
		}
	}
	return nil
}
