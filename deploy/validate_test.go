package deploy_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/rules"
)

// TestYAMLParses: every YAML file under deploy/ parses, every document of
// it (Kubernetes files are multi-document).
func TestYAMLParses(t *testing.T) {
	files := deployFiles(t, ".yaml", ".yml")
	if len(files) < 8 {
		t.Fatalf("only %d YAML files under deploy/: %v", len(files), files)
	}
	for _, f := range files {
		if docs := yamlDocs(t, f); len(docs) == 0 {
			t.Errorf("%s: no YAML document", f)
		}
	}
}

// k8sObject is one Kubernetes manifest document.
type k8sObject struct {
	file string
	doc  map[string]any
}

func (o k8sObject) kind() string { return str(o.doc["kind"]) }
func (o k8sObject) name() string { return str(dig(o.doc, "metadata", "name")) }

func k8sObjects(t *testing.T) []k8sObject {
	t.Helper()
	var objs []k8sObject
	for _, f := range deployFiles(t, ".yaml") {
		if !strings.HasPrefix(f, "kubernetes/") || filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		for _, d := range yamlDocs(t, f) {
			objs = append(objs, k8sObject{f, d})
		}
	}
	return objs
}

func findObject(objs []k8sObject, kind, name string) *k8sObject {
	for i := range objs {
		if objs[i].kind() == kind && objs[i].name() == name {
			return &objs[i]
		}
	}
	return nil
}

// TestKubernetesManifests: every object is well-formed, and the allocator's
// StatefulSet, Services, PodDisruptionBudget and ConfigMaps fit together
// as docs/operations.md describes.
func TestKubernetesManifests(t *testing.T) {
	objs := k8sObjects(t)
	if len(objs) < 10 {
		t.Fatalf("only %d Kubernetes objects", len(objs))
	}
	for _, o := range objs {
		if str(o.doc["apiVersion"]) == "" || o.kind() == "" || o.name() == "" {
			t.Errorf("%s: an object without apiVersion, kind or metadata.name: %v", o.file, o.doc)
		}
	}

	// kustomization.yaml lists files that exist.
	kust := yamlDocs(t, "kubernetes/kustomization.yaml")[0]
	for _, r := range kust["resources"].([]any) {
		if _, err := os.Stat(filepath.Join("kubernetes", str(r))); err != nil {
			t.Errorf("kustomization.yaml: resource %v: %v", r, err)
		}
	}

	sts := findObject(objs, "StatefulSet", "allot-allocator")
	if sts == nil {
		t.Fatal("no StatefulSet allot-allocator")
	}
	spec := sts.doc["spec"]
	if r, _ := dig(spec, "replicas").(int); r != 3 {
		t.Errorf("StatefulSet replicas = %v, want 3", dig(spec, "replicas"))
	}
	if p := str(dig(spec, "podManagementPolicy")); p != "Parallel" {
		t.Errorf("podManagementPolicy = %q, want Parallel", p)
	}
	if vct, _ := dig(spec, "volumeClaimTemplates").([]any); len(vct) == 0 {
		t.Error("StatefulSet has no volumeClaimTemplates")
	}
	headless := findObject(objs, "Service", str(dig(spec, "serviceName")))
	if headless == nil {
		t.Fatalf("serviceName %q names no Service", dig(spec, "serviceName"))
	}
	if str(dig(headless.doc, "spec", "clusterIP")) != "None" {
		t.Errorf("Service %s is not headless", headless.name())
	}
	if dig(headless.doc, "spec", "publishNotReadyAddresses") != true {
		t.Errorf("Service %s: publishNotReadyAddresses should be true (members reach nodes that are catching up)", headless.name())
	}
	labels := dig(spec, "template", "metadata", "labels").(map[string]any)
	selects := func(sel any) bool {
		m, _ := sel.(map[string]any)
		if len(m) == 0 {
			return false
		}
		for k, v := range m {
			if labels[k] != v {
				return false
			}
		}
		return true
	}
	if !selects(dig(headless.doc, "spec", "selector")) {
		t.Errorf("Service %s does not select the StatefulSet's pods", headless.name())
	}
	pdb := findObject(objs, "PodDisruptionBudget", "allot-allocator")
	if pdb == nil {
		t.Fatal("no PodDisruptionBudget allot-allocator")
	}
	if m, _ := dig(pdb.doc, "spec", "maxUnavailable").(int); m != 1 {
		t.Errorf("PDB maxUnavailable = %v, want 1", dig(pdb.doc, "spec", "maxUnavailable"))
	}
	if !selects(dig(pdb.doc, "spec", "selector", "matchLabels")) {
		t.Error("the PodDisruptionBudget does not select the allocator pods")
	}
	c := dig(spec, "template", "spec", "containers", 0)
	if p := str(dig(c, "readinessProbe", "httpGet", "path")); p != "/readyz" {
		t.Errorf("allocator readiness probe path = %q, want /readyz", p)
	}
	if p := str(dig(c, "livenessProbe", "httpGet", "path")); p != "/healthz" {
		t.Errorf("allocator liveness probe path = %q, want /healthz", p)
	}

	// Every configMap volume, and the gateway's probes.
	for _, o := range objs {
		if o.kind() != "StatefulSet" && o.kind() != "Deployment" {
			continue
		}
		for _, v := range asList(dig(o.doc, "spec", "template", "spec", "volumes")) {
			if cm := str(dig(v, "configMap", "name")); cm != "" && findObject(objs, "ConfigMap", cm) == nil {
				t.Errorf("%s %s: volume uses ConfigMap %q, which is not defined", o.kind(), o.name(), cm)
			}
		}
	}
	gw := findObject(objs, "Deployment", "allot-gateway")
	if gw == nil {
		t.Fatal("no Deployment allot-gateway")
	}
	if findObject(objs, "Service", "allot-gateway") == nil {
		t.Error("no Service allot-gateway")
	}
	gc := dig(gw.doc, "spec", "template", "spec", "containers", 0)
	if str(dig(gc, "readinessProbe", "httpGet", "path")) != "/readyz" || str(dig(gc, "livenessProbe", "httpGet", "path")) != "/healthz" {
		t.Error("gateway probes should be /readyz (readiness) and /healthz (liveness)")
	}
	side := findObject(objs, "Deployment", "search-api")
	if side == nil || len(asList(dig(side.doc, "spec", "template", "spec", "containers"))) != 2 {
		t.Error("sidecar example: want Deployment search-api with an app and a gateway container")
	}
}

func asList(v any) []any {
	l, _ := v.([]any)
	return l
}

// TestRulesAreTheDesignCard: the local rules file and the Kubernetes rules
// ConfigMap are the example rules (pkg/rules' ExampleYAML).
func TestRulesAreTheDesignCard(t *testing.T) {
	local := string(readFile(t, "local/rules/public-api.yaml"))
	if local != rules.ExampleYAML {
		t.Error("deploy/local/rules/public-api.yaml differs from pkg/rules/example.yaml (the example rules); copy it again")
	}
	cm := findObject(k8sObjects(t), "ConfigMap", "allot-rules")
	if cm == nil {
		t.Fatal("no ConfigMap allot-rules")
	}
	if got := str(dig(cm.doc, "data", "public-api.yaml")); got != local {
		t.Error("ConfigMap allot-rules differs from deploy/local/rules/public-api.yaml")
	}
	if _, err := rules.LoadFiles(1, "local/rules"); err != nil {
		t.Fatal(err)
	}
}

// gatewayFile mirrors cmd/gateway's config file (strict: unknown keys are
// errors there too), to check the shipped files without starting a gateway.
type gatewayFile struct {
	Upstream     string         `yaml:"upstream"`
	Allocators   []string       `yaml:"allocators"`
	Rules        []string       `yaml:"rules"`
	TLS          map[string]any `yaml:"tls"`
	UpstreamTLS  map[string]any `yaml:"upstream_tls"`
	AllocatorTLS map[string]any `yaml:"allocator_tls"`

	httplimit.Config `yaml:",inline"`
}

// TestGatewayConfigs: the gateway config files shipped (local, Kubernetes,
// sidecar) decode strictly and their descriptor extraction is valid.
func TestGatewayConfigs(t *testing.T) {
	check := func(name string, src []byte) {
		t.Helper()
		dec := yaml.NewDecoder(bytes.NewReader(src))
		dec.KnownFields(true)
		var f gatewayFile
		if err := dec.Decode(&f); err != nil {
			t.Errorf("%s: %v", name, err)
			return
		}
		if _, err := httplimit.NewExtractor(f.Config); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		if f.Domain != "public-api" || len(f.Descriptors) != 3 {
			t.Errorf("%s: domain %q with %d descriptors, want public-api with the example's three", name, f.Domain, len(f.Descriptors))
		}
	}
	check("local/gateway.yaml", readFile(t, "local/gateway.yaml"))
	objs := k8sObjects(t)
	for _, name := range []string{"allot-gateway", "search-api-ratelimit"} {
		cm := findObject(objs, "ConfigMap", name)
		if cm == nil {
			t.Fatalf("no ConfigMap %s", name)
		}
		check("ConfigMap "+name, []byte(str(dig(cm.doc, "data", "gateway.yaml"))))
	}
}

// TestShellScripts: every script passes bash -n (and shellcheck, where it
// is installed), the Kubernetes entrypoint included.
func TestShellScripts(t *testing.T) {
	scripts := map[string][]byte{}
	for _, f := range deployFiles(t, ".sh") {
		scripts[f] = readFile(t, f)
	}
	for _, o := range k8sObjects(t) {
		if o.kind() != "ConfigMap" {
			continue
		}
		for k, v := range dig(o.doc, "data").(map[string]any) {
			if strings.HasSuffix(k, ".sh") {
				scripts[o.file+":"+o.name()+"/"+k] = []byte(str(v))
			}
		}
	}
	if len(scripts) < 3 {
		t.Fatalf("only %d scripts found", len(scripts))
	}
	shellcheck, _ := exec.LookPath("shellcheck")
	for name, src := range scripts {
		shell := "bash"
		if bytes.HasPrefix(src, []byte("#!/bin/sh")) {
			shell = "sh"
		}
		cmd := exec.Command(shell, "-n")
		cmd.Stdin = bytes.NewReader(src)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s: %s -n: %v\n%s", name, shell, err, out)
		}
		if shellcheck != "" {
			cmd := exec.Command(shellcheck, "-s", shell, "-")
			cmd.Stdin = bytes.NewReader(src)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Errorf("%s: shellcheck: %v\n%s", name, err, out)
			}
		}
	}
}

// unitFile parses a systemd unit: section → key → values (in order), with
// continuation lines joined.
func unitFile(t *testing.T, path string) map[string]map[string][]string {
	t.Helper()
	out := map[string]map[string][]string{}
	section := ""
	var pending string
	sc := bufio.NewScanner(bytes.NewReader(readFile(t, path)))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if pending != "" {
			line = pending + " " + line
			pending = ""
		}
		if strings.HasSuffix(line, "\\") {
			pending = strings.TrimSuffix(line, "\\")
			continue
		}
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "["):
			section = strings.Trim(line, "[]")
			out[section] = map[string][]string{}
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok || section == "" {
				t.Fatalf("%s: bad line %q", path, line)
			}
			out[section][k] = append(out[section][k], strings.Join(strings.Fields(v), " "))
		}
	}
	return out
}

// TestSystemdUnits: the units restart on failure, stop with SIGTERM within
// a bound longer than the binaries' -shutdown-timeout, read an
// EnvironmentFile and are hardened; systemd-analyze verify (where
// installed) reports nothing about them.
func TestSystemdUnits(t *testing.T) {
	units := deployFiles(t, ".service")
	if len(units) != 2 {
		t.Fatalf("want the allocator and gateway units, got %v", units)
	}
	want := map[string]string{
		"Restart": "on-failure", "KillSignal": "SIGTERM", "NoNewPrivileges": "yes",
		"ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes", "PrivateDevices": "yes",
		"ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
		"RestrictNamespaces": "yes", "LockPersonality": "yes", "MemoryDenyWriteExecute": "yes",
		"SystemCallArchitectures": "native", "CapabilityBoundingSet": "", "DynamicUser": "yes",
	}
	for _, u := range units {
		svc := unitFile(t, u)["Service"]
		for k, v := range want {
			if got := svc[k]; len(got) == 0 || got[len(got)-1] != v {
				t.Errorf("%s: %s = %v, want %q", u, k, got, v)
			}
		}
		if len(svc["EnvironmentFile"]) == 0 {
			t.Errorf("%s: no EnvironmentFile", u)
		}
		if len(svc["ExecStart"]) != 1 || !strings.Contains(svc["ExecStart"][0], "-shutdown-timeout 20s") {
			t.Errorf("%s: ExecStart should pass -shutdown-timeout 20s: %v", u, svc["ExecStart"])
		}
		if ts := svc["TimeoutStopSec"]; len(ts) == 0 || ts[0] != "30s" {
			t.Errorf("%s: TimeoutStopSec = %v, want 30s (beyond -shutdown-timeout)", u, ts)
		}
	}
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Log("systemd-analyze not installed: verify skipped")
		return
	}
	// verify wants the ExecStart binaries to exist and a concrete instance
	// name for the template.
	bin := binaries(t)
	dir := t.TempDir()
	var paths []string
	for _, u := range units {
		src := strings.ReplaceAll(string(readFile(t, u)), "/usr/local/bin/", bin+"/")
		name := filepath.Base(u)
		name = strings.Replace(name, "@.service", "@alloc-1.service", 1)
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	out, _ := exec.Command(analyze, append([]string{"verify"}, paths...)...).CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, dir) {
			t.Errorf("systemd-analyze verify: %s", line)
		}
	}
}

// flagUse is a flag an artifact passes to a binary.
type flagUse struct {
	where, bin string // bin: allocator, gateway or "allotctl <sub>"
	flag       string
}

var (
	flagToken      = regexp.MustCompile(`^-{1,2}([a-zA-Z][a-zA-Z0-9-]*)(=.*)?$`)
	subcommandWord = regexp.MustCompile(`^[a-z][a-z-]*$`)
)

// flagsIn returns the flags among whitespace-separated, possibly quoted
// tokens.
func flagsIn(text string) []string {
	var out []string
	for _, tok := range strings.Fields(text) {
		tok = strings.Trim(tok, `"'`)
		if m := flagToken.FindStringSubmatch(tok); m != nil {
			out = append(out, m[1])
		}
	}
	return out
}

// logicalLines joins backslash-continued lines.
func logicalLines(src string) []string {
	var out []string
	var cur strings.Builder
	for _, l := range strings.Split(src, "\n") {
		t := strings.TrimSpace(l)
		if strings.HasSuffix(t, "\\") {
			cur.WriteString(strings.TrimSuffix(t, "\\"))
			cur.WriteByte(' ')
			continue
		}
		cur.WriteString(t)
		out = append(out, cur.String())
		cur.Reset()
	}
	return out
}

// allotctlUses finds allotctl invocations in shell text: the subcommand
// words after the binary, then the flags.
func allotctlUses(where, src string) []flagUse {
	var out []flagUse
	for _, line := range logicalLines(src) {
		fields := strings.Fields(line)
		for i, f := range fields {
			if filepath.Base(strings.Trim(f, `"'`)) != "allotctl" {
				continue
			}
			// Words are subcommands, except the value after a flag
			// written without "=".
			var sub, flags []string
			value := false
			for _, a := range fields[i+1:] {
				if strings.HasPrefix(a, ">") || strings.HasPrefix(a, "2>") || a == "|" || a == ";" || a == "&&" || a == "||" {
					break
				}
				if m := flagToken.FindStringSubmatch(strings.Trim(a, `"'`)); m != nil {
					flags = append(flags, m[1])
					value = m[2] == ""
					continue
				}
				if !value && subcommandWord.MatchString(a) {
					sub = append(sub, a)
				}
				value = false
			}
			for _, fl := range flags {
				out = append(out, flagUse{where, strings.TrimSpace("allotctl " + strings.Join(sub, " ")), fl})
			}
		}
	}
	return out
}

// shellArrayFlags returns the flags in cluster.sh's NAME=( … ) and
// NAME+=( … ) arrays.
func shellArrayFlags(src, name string) []string {
	var out []string
	lines := strings.Split(src, "\n")
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		j := strings.Index(l, name+"=(")
		if j < 0 {
			j = strings.Index(l, name+"+=(")
		}
		if j < 0 {
			continue
		}
		body := l[strings.Index(l, "(")+1:]
		if strings.HasSuffix(strings.TrimSpace(body), ")") {
			out = append(out, flagsIn(strings.TrimSuffix(strings.TrimSpace(body), ")"))...)
			continue
		}
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != ")"; i++ {
			out = append(out, flagsIn(lines[i])...)
		}
	}
	return out
}

// TestFlagsExist: every flag the systemd units, their env examples, the
// Kubernetes manifests and entrypoint, and cluster.sh pass to allocator,
// gateway or allotctl is one the binary defines (its -h output).
func TestFlagsExist(t *testing.T) {
	var uses []flagUse
	add := func(where, bin string, flags []string) {
		if len(flags) == 0 {
			t.Errorf("%s: no flags found for %s (has the file's layout changed?)", where, bin)
		}
		for _, f := range flags {
			uses = append(uses, flagUse{where, bin, f})
		}
	}

	// systemd: ExecStart and the *_OPTS of the env examples.
	for _, u := range deployFiles(t, ".service") {
		exec := unitFile(t, u)["Service"]["ExecStart"][0]
		bin := filepath.Base(strings.Fields(exec)[0])
		add(u, bin, flagsIn(exec))
		env := strings.TrimSuffix(filepath.Base(u), ".service")
		env = strings.TrimPrefix(strings.TrimSuffix(env, "@"), "allot-") + ".env.example"
		var opts []string
		for _, l := range strings.Split(string(readFile(t, filepath.Join("systemd", env))), "\n") {
			l = strings.TrimPrefix(strings.TrimSpace(l), "#")
			if k, v, ok := strings.Cut(l, "="); ok && strings.HasSuffix(k, "_OPTS") {
				opts = append(opts, flagsIn(v)...)
			}
		}
		add("systemd/"+env, bin, opts)
	}

	// cluster.sh.
	src := string(readFile(t, "local/cluster.sh"))
	add("local/cluster.sh", "allocator", shellArrayFlags(src, "allocator_args"))
	add("local/cluster.sh", "gateway", shellArrayFlags(src, "gateway_args"))

	// Kubernetes: gateway containers' args, the allocator entrypoint's
	// `set --` lines, and its allotctl call.
	for _, o := range k8sObjects(t) {
		switch o.kind() {
		case "Deployment", "StatefulSet":
			for _, c := range asList(dig(o.doc, "spec", "template", "spec", "containers")) {
				cmd := asList(dig(c, "command"))
				if len(cmd) == 0 || filepath.Base(str(cmd[0])) != "gateway" {
					continue
				}
				var args []string
				for _, a := range asList(dig(c, "args")) {
					args = append(args, str(a))
				}
				add(o.file+":"+o.name(), "gateway", flagsIn(strings.Join(args, " ")))
			}
		case "ConfigMap":
			script := str(dig(o.doc, "data", "allocator.sh"))
			if script == "" {
				continue
			}
			var flags []string
			for _, l := range logicalLines(script) {
				if strings.HasPrefix(l, "set -- ") {
					flags = append(flags, flagsIn(strings.TrimPrefix(l, "set -- "))...)
				}
			}
			add(o.file+":allocator.sh", "allocator", flags)
			uses = append(uses, allotctlUses(o.file+":allocator.sh", script)...)
		}
	}

	bin := binaries(t)
	defined := map[string]map[string]bool{}
	flagsOf := func(b string) map[string]bool {
		if defined[b] == nil {
			args := strings.Fields(b)
			path := filepath.Join(bin, args[0])
			if args[0] == "allotctl" {
				defined[b] = helpFlags(t, path, append(args[1:], "--help")...)
			} else {
				defined[b] = helpFlags(t, path, "-h")
			}
		}
		return defined[b]
	}
	for _, u := range uses {
		if !flagsOf(u.bin)[u.flag] {
			t.Errorf("%s: %s has no flag -%s (defined: %v)", u.where, u.bin, u.flag, sortedKeys(flagsOf(u.bin)))
		}
	}
	t.Logf("%d flag uses checked", len(uses))
}

// TestDevCerts runs gen-dev-certs.sh and checks what it made: every
// certificate chains to the CA for its usage, carries its role in the OU
// and a spiffe://allot/... URI, and loads as a key pair; a second run
// reuses the CA.
func TestDevCerts(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl not installed")
	}
	dir := filepath.Join(t.TempDir(), "certs")
	run := func() {
		cmd := exec.Command("bash", "certs/gen-dev-certs.sh", dir)
		cmd.Env = append(os.Environ(), "ALLOT_AGENT_IDS=gw-1 gw-2", "ALLOT_CERT_HOSTS=DNS:allot.example.com")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("gen-dev-certs.sh: %v\n%s", err, out)
		}
	}
	run()
	caPEM := readFile(t, filepath.Join(dir, "ca.crt"))
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("ca.crt: no certificate")
	}
	cases := []struct {
		name, ou, uri string
		usage         x509.ExtKeyUsage
		dns           string
	}{
		{"allocator", "allocator", "spiffe://allot/allocator", x509.ExtKeyUsageServerAuth, "allot-allocator-1.allot-allocator-peers.allot.svc.cluster.local"},
		{"allocator", "allocator", "spiffe://allot/allocator", x509.ExtKeyUsageClientAuth, ""},
		{"gateway", "gateway", "spiffe://allot/gateway", x509.ExtKeyUsageServerAuth, "allot.example.com"},
		{"agent-gw-1", "agent", "spiffe://allot/agent/gw-1", x509.ExtKeyUsageClientAuth, ""},
		{"agent-gw-2", "agent", "spiffe://allot/agent/gw-2", x509.ExtKeyUsageClientAuth, ""},
		{"admin", "admin", "spiffe://allot/admin", x509.ExtKeyUsageClientAuth, ""},
	}
	for _, c := range cases {
		crt := filepath.Join(dir, c.name+".crt")
		if _, err := tls.LoadX509KeyPair(crt, filepath.Join(dir, c.name+".key")); err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		block, _ := pem.Decode(readFile(t, crt))
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{c.usage}, DNSName: c.dns}); err != nil {
			t.Errorf("%s: verify for %v %q: %v", c.name, c.usage, c.dns, err)
		}
		if !slices.Contains(cert.Subject.OrganizationalUnit, c.ou) {
			t.Errorf("%s: OU %v, want %s", c.name, cert.Subject.OrganizationalUnit, c.ou)
		}
		if len(cert.URIs) != 1 || cert.URIs[0].String() != c.uri {
			t.Errorf("%s: URIs %v, want %s", c.name, cert.URIs, c.uri)
		}
		if info, err := os.Stat(filepath.Join(dir, c.name+".key")); err != nil || info.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s.key: mode %v, want no group/other access", c.name, info.Mode())
		}
	}
	run()
	if !bytes.Equal(caPEM, readFile(t, filepath.Join(dir, "ca.crt"))) {
		t.Error("a second run replaced the CA")
	}
}

// metricNames scans the repository's Go sources (tests excluded) for the
// Prometheus metric names they define: prometheus.*Opts literals
// (Namespace_Subsystem_Name), NewDesc calls, and allot_* string constants.
func metricNames(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	fset := token.NewFileSet()
	nameRE := regexp.MustCompile(`^allot_[a-z0-9_]+$`)
	pkgs := map[string][]*ast.File{}
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if b := d.Name(); b == ".git" || b == "deploy" || b == "testdata" || strings.HasPrefix(b, ".") && path != root {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		pkgs[filepath.Dir(path)] = append(pkgs[filepath.Dir(path)], f)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, files := range pkgs {
		consts := map[string]ast.Expr{}
		for _, f := range files {
			for _, decl := range f.Decls {
				gd, ok := decl.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if i < len(vs.Values) {
							consts[n.Name] = vs.Values[i]
						}
					}
				}
			}
		}
		var eval func(e ast.Expr, depth int) (string, bool)
		eval = func(e ast.Expr, depth int) (string, bool) {
			if depth > 8 {
				return "", false
			}
			switch e := e.(type) {
			case *ast.BasicLit:
				if e.Kind != token.STRING {
					return "", false
				}
				s, err := strconv.Unquote(e.Value)
				return s, err == nil
			case *ast.Ident:
				if c, ok := consts[e.Name]; ok {
					return eval(c, depth+1)
				}
			case *ast.BinaryExpr:
				if e.Op == token.ADD {
					a, ok1 := eval(e.X, depth+1)
					b, ok2 := eval(e.Y, depth+1)
					return a + b, ok1 && ok2
				}
			case *ast.ParenExpr:
				return eval(e.X, depth+1)
			}
			return "", false
		}
		for _, f := range files {
			ast.Inspect(f, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.BasicLit:
					if s, ok := eval(n, 0); ok && nameRE.MatchString(s) {
						names[s] = true
					}
				case *ast.CompositeLit:
					sel, ok := n.Type.(*ast.SelectorExpr)
					if !ok || !strings.HasSuffix(sel.Sel.Name, "Opts") {
						return true
					}
					parts := map[string]string{}
					for _, el := range n.Elts {
						kv, ok := el.(*ast.KeyValueExpr)
						if !ok {
							continue
						}
						k, _ := kv.Key.(*ast.Ident)
						if k == nil {
							continue
						}
						if s, ok := eval(kv.Value, 0); ok {
							parts[k.Name] = s
						}
					}
					if parts["Name"] != "" {
						var full []string
						for _, p := range []string{parts["Namespace"], parts["Subsystem"], parts["Name"]} {
							if p != "" {
								full = append(full, p)
							}
						}
						names[strings.Join(full, "_")] = true
					}
				case *ast.CallExpr:
					if sel, ok := n.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "NewDesc" && len(n.Args) > 0 {
						if s, ok := eval(n.Args[0], 0); ok {
							names[s] = true
						}
					}
				}
				return true
			})
		}
	}
	return names
}

var (
	promStrings  = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)
	promBraces   = regexp.MustCompile(`\{[^{}]*\}`)
	promRanges   = regexp.MustCompile(`\[[^\[\]]*\]`)
	promGrouping = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)`)
	promIdent    = regexp.MustCompile(`\$?[a-zA-Z_:][a-zA-Z0-9_:]*`)
	promKeywords = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true,
		"group_right": true, "bool": true, "and": true, "or": true, "unless": true, "offset": true, "inf": true, "nan": true}
)

// promMetrics returns the metric names a PromQL expression selects.
func promMetrics(expr string) []string {
	e := promStrings.ReplaceAllString(expr, `""`)
	e = promBraces.ReplaceAllString(e, " ")
	e = promRanges.ReplaceAllString(e, " ")
	e = promGrouping.ReplaceAllString(e, " ")
	var out []string
	for _, loc := range promIdent.FindAllStringIndex(e, -1) {
		id := e[loc[0]:loc[1]]
		if strings.HasPrefix(id, "$") || promKeywords[strings.ToLower(id)] {
			continue
		}
		if rest := strings.TrimLeft(e[loc[1]:], " \t\n"); strings.HasPrefix(rest, "(") {
			continue // a function
		}
		out = append(out, id)
	}
	return out
}

func knownMetric(names map[string]bool, m string) bool {
	if names[m] {
		return true
	}
	for _, suf := range []string{"_bucket", "_count", "_sum"} {
		if base, ok := strings.CutSuffix(m, suf); ok && names[base] {
			return true
		}
	}
	return false
}

type dashboard struct {
	Title  string `json:"title"`
	UID    string `json:"uid"`
	Panels []struct {
		Type    string `json:"type"`
		Title   string `json:"title"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	var dash dashboard
	if err := json.Unmarshal(readFile(t, "grafana/allot-dashboard.json"), &dash); err != nil {
		t.Fatal(err)
	}
	return dash
}

// dashboardExprs lists the dashboard's queries.
func dashboardExprs(t *testing.T) []string {
	var out []string
	for _, p := range loadDashboard(t).Panels {
		for _, tg := range p.Targets {
			out = append(out, tg.Expr)
		}
	}
	return out
}

// TestDashboard: the Grafana dashboard parses, every panel has queries, and
// every metric they select is defined in the Go sources.
func TestDashboard(t *testing.T) {
	dash := loadDashboard(t)
	if dash.Title == "" || dash.UID == "" {
		t.Error("dashboard without title or uid")
	}
	names := metricNames(t)
	for _, must := range []string{"allot_gateway_requests_total", "allot_agent_decisions_total", "allot_allocator_raft_apply_seconds"} {
		if !names[must] {
			t.Fatalf("the source scan did not find %s (found %v)", must, sortedKeys(names))
		}
	}
	used := map[string]bool{}
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		for _, tg := range p.Targets {
			ms := promMetrics(tg.Expr)
			if len(ms) == 0 {
				t.Errorf("panel %q: no metric in %q", p.Title, tg.Expr)
			}
			for _, m := range ms {
				used[m] = true
				if !knownMetric(names, m) {
					t.Errorf("panel %q: metric %s is not defined in the code (query %q)", p.Title, m, tg.Expr)
				}
			}
		}
	}
	// The panels for these metrics stay on the dashboard.
	for _, m := range []string{
		"allot_agent_check_seconds_bucket", "allot_agent_rule_decisions_total",
		"allot_agent_acquire_calls_total", "allot_agent_tokens_total",
		"allot_allocator_rejected_calls_total", "allot_allocator_inflight_calls",
		"allot_allocator_snapshot_capture_seconds_bucket", "allot_allocator_snapshot_persist_seconds_bucket",
		"allot_allocator_snapshot_restore_seconds_bucket", "allot_allocator_snapshot_bytes_bucket",
		"allot_allocator_snapshot_failures_total", "allot_allocator_snapshot_last_index",
		"allot_allocator_snapshot_last_timestamp_seconds",
	} {
		if !used[m] {
			t.Errorf("no panel queries %s", m)
		}
	}
	for _, sel := range []string{`result="throttled"`, `kind="paid"`} {
		found := false
		for _, p := range dash.Panels {
			for _, tg := range p.Targets {
				found = found || strings.Contains(tg.Expr, sel)
			}
		}
		if !found {
			t.Errorf("no panel selects %s", sel)
		}
	}
	t.Logf("%d panels use %d metrics: %v", len(dash.Panels), len(used), sortedKeys(used))
}

func TestPromMetrics(t *testing.T) {
	cases := map[string][]string{
		`sum by (result) (rate(allot_gateway_requests_total{job=~"$gateway_job"}[$__rate_interval]))`: {"allot_gateway_requests_total"},
		`histogram_quantile(0.99, sum by (le) (rate(x_bucket{a="b"}[5m])))`:                           {"x_bucket"},
		`a{job=~"x"} - b`:                        {"a", "b"},
		`max by (type) (rate(c[1m])) / on (x) d`: {"c", "d"},
	}
	for expr, want := range cases {
		if got := promMetrics(expr); !slices.Equal(got, want) {
			t.Errorf("promMetrics(%q) = %v, want %v", expr, got, want)
		}
	}
}
