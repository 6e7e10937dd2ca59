package deploy_test

import (
	"bytes"
	"io"
	"net/http"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/allot/allot/internal/testproc"
)

type alertRule struct {
	Alert string `yaml:"alert"`
	Expr  string `yaml:"expr"`
}

func loadAlerts(t *testing.T) []alertRule {
	t.Helper()
	var f struct {
		Groups []struct {
			Rules []alertRule `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(readFile(t, "prometheus/alerts.yaml"), &f); err != nil {
		t.Fatal(err)
	}
	var out []alertRule
	for _, g := range f.Groups {
		out = append(out, g.Rules...)
	}
	return out
}

// TestAlertRules: deploy/prometheus/alerts.yaml holds exactly the alerts
// docs/operations.md lists (the same expressions), over metrics the code
// defines; promtool accepts the file and its unit tests
// (alerts_test.yaml) pass.
func TestAlertRules(t *testing.T) {
	alerts := loadAlerts(t)
	var exprs []string
	names := metricNames(t)
	for _, a := range alerts {
		exprs = append(exprs, a.Expr)
		for _, m := range promMetrics(a.Expr) {
			if !knownMetric(names, m) {
				t.Errorf("alert %s: metric %s is not defined in the code", a.Alert, m)
			}
		}
	}
	doc := string(readFile(t, "../docs/operations.md"))
	_, block, ok := strings.Cut(doc, "Alerts worth having")
	if !ok {
		t.Fatal(`docs/operations.md: no "Alerts worth having" section`)
	}
	_, block, _ = strings.Cut(block, "```\n")
	block, _, _ = strings.Cut(block, "```")
	var documented []string
	for _, line := range strings.Split(block, "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			documented = append(documented, line)
		}
	}
	sort.Strings(exprs)
	sort.Strings(documented)
	if len(exprs) != 10 || !slices.Equal(exprs, documented) {
		t.Errorf("alerts.yaml has %d expressions, docs/operations.md lists %d; they must be the same ten:\nfile: %q\ndocs: %q",
			len(exprs), len(documented), exprs, documented)
	}
	promtool := testproc.Tool(t, "promtool")
	for _, args := range [][]string{{"check", "rules", "prometheus/alerts.yaml"}, {"test", "rules", "prometheus/alerts_test.yaml"}} {
		if out, err := exec.Command(promtool, args...).CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

var selectorRE = regexp.MustCompile(`([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}`)
var labelEqRE = regexp.MustCompile(`([a-z_]+)="([^"]*)"`)

// TestMetricsAtStart starts an allocator, a gateway leasing from it and a
// `gateway -dev`, sends no traffic, and checks that every metric an alert
// or a dashboard panel uses is already exposed by the process it belongs
// to (counters at 0, so increase() sees the first event), with the label
// values the alerts select; that `promtool check metrics` accepts each
// /metrics; and that the dev gateway's embedded allocator is labelled
// embedded="true", which the cluster alerts exclude.
func TestMetricsAtStart(t *testing.T) {
	bins := cmdBinaries(t)
	promtool := testproc.Tool(t, "promtool")
	dir := t.TempDir()
	rulesFile := testproc.WriteFile(t, dir, "rules.yaml", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10}\n")
	c := testproc.StartCluster(t, testproc.ClusterConfig{Bin: bins.Allocator, Dir: dir, Size: 1, Rules: []string{rulesFile}})
	up := testproc.StartUpstream(t)
	// With a Redis backend configured (its metrics exist from the start;
	// nothing listens there, and no request is sent) and the RLS server.
	redisAddr := testproc.FreeAddrs(t, 1)[0]
	gw := testproc.StartGateway(t, bins.Gateway, dir, "gw",
		"upstream: "+up.URL+"\nredis: {addrs: ["+redisAddr+"]}\ndomain: d\ndescriptors: [[{key: k, header: X-K}]]\n",
		c.GRPCAddrs(), "-rls-addr", "127.0.0.1:0")
	dev := testproc.NewProc("dev", dir, bins.Gateway, "-dev", "-listen", "127.0.0.1:0", "-rls-addr", "", "-http-addr", "127.0.0.1:0", "-check-addr", "127.0.0.1:0")
	dev.Start(t)
	devHTTP := ""
	listening := regexp.MustCompile(`allot gateway listening: proxy=\S* rls=\S* http=(\S*)`)
	testproc.Eventually(t, 60*time.Second, "the gateways' readiness", func() bool {
		if m := listening.FindStringSubmatch(dev.Output()); m != nil {
			devHTTP = m[1]
		}
		return gw.Ready() && devHTTP != "" && get200("http://"+devHTTP+"/readyz")
	})

	// Which metrics are used, and with which exact label values.
	used := map[string][]map[string]string{}
	addExpr := func(expr string) {
		for _, m := range promMetrics(expr) {
			if _, ok := used[m]; !ok {
				used[m] = nil
			}
		}
		for _, sel := range selectorRE.FindAllStringSubmatch(expr, -1) {
			lv := map[string]string{}
			for _, eq := range labelEqRE.FindAllStringSubmatch(sel[2], -1) {
				if !strings.HasPrefix(eq[2], "$") && eq[1] != "embedded" {
					lv[eq[1]] = eq[2]
				}
			}
			if len(lv) > 0 {
				used[sel[1]] = append(used[sel[1]], lv)
			}
		}
	}
	for _, a := range loadAlerts(t) {
		addExpr(a.Expr)
	}
	for _, e := range dashboardExprs(t) {
		addExpr(e)
	}

	scrapes := map[string]string{
		"allocator":    "http://" + c.Nodes[0].HTTP + "/metrics",
		"gateway":      "http://" + gw.HTTP + "/metrics",
		"gateway -dev": "http://" + devHTTP + "/metrics",
	}
	texts := map[string]string{}
	for name, url := range scrapes {
		texts[name] = fetch(t, url)
		cmd := exec.Command(promtool, "check", "metrics")
		cmd.Stdin = strings.NewReader(texts[name])
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool check metrics on the %s's /metrics: %v\n%s", name, err, out)
		}
	}
	for m, sels := range used {
		owner := "gateway"
		if strings.HasPrefix(m, "allot_allocator_") {
			owner = "allocator"
		}
		if !exposed(texts[owner], m, nil) {
			t.Errorf("%s: not exposed by a fresh %s", m, owner)
			continue
		}
		for _, lv := range sels {
			if !exposed(texts[owner], m, lv) {
				t.Errorf("%s%v: not exposed by a fresh %s", m, lv, owner)
			}
		}
	}
	if !strings.Contains(texts["gateway -dev"], `allot_allocator_is_leader{embedded="true"} 1`) {
		t.Errorf("the dev gateway's embedded allocator is not labelled embedded=\"true\":\n%s", grepLines(texts["gateway -dev"], "allot_allocator_is_leader"))
	}
	if strings.Contains(texts["allocator"], `embedded=`) {
		t.Error("an allocator's own metrics carry the embedded label")
	}
}

func get200(url string) bool {
	resp, err := http.Get(url)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func fetch(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return string(b)
}

// exposed reports whether text has a sample of metric m (a histogram's
// _bucket/_sum/_count included) with every label value in lv.
func exposed(text, m string, lv map[string]string) bool {
	for _, line := range strings.Split(text, "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		if name != m {
			continue
		}
		ok := true
		for k, v := range lv {
			ok = ok && strings.Contains(rest, k+`="`+v+`"`)
		}
		if ok {
			return true
		}
	}
	return false
}

func grepLines(text, s string) string {
	var b bytes.Buffer
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, s) {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}
