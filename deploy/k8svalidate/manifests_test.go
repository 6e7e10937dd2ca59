package k8svalidate

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// dir holds the manifests.
const dir = "../kubernetes"

// object is one decoded manifest document.
type object struct {
	file string
	doc  int
	obj  any // a pointer to the k8s.io/api type of its kind
	meta metav1.ObjectMeta
}

func (o object) String() string {
	return fmt.Sprintf("%s (document %d) %s/%s", o.file, o.doc, o.meta.Namespace, o.meta.Name)
}

// kustomization is kustomize's file: not a Kubernetes API type.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
}

// newObject returns an empty object of the API type for apiVersion and
// kind, or nil when the test does not know it.
func newObject(apiVersion, kind string) any {
	switch apiVersion + " " + kind {
	case "v1 Namespace":
		return &corev1.Namespace{}
	case "v1 Service":
		return &corev1.Service{}
	case "v1 ConfigMap":
		return &corev1.ConfigMap{}
	case "apps/v1 StatefulSet":
		return &appsv1.StatefulSet{}
	case "apps/v1 Deployment":
		return &appsv1.Deployment{}
	case "policy/v1 PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}
	case "networking.k8s.io/v1 NetworkPolicy":
		return &networkingv1.NetworkPolicy{}
	case "kustomize.config.k8s.io/v1beta1 Kustomization":
		return &kustomization{}
	}
	return nil
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// decodeStrict decodes one YAML document into the API type of its kind:
// an unknown or misspelled field, a duplicate key or a value of the wrong
// type is an error.
func decodeStrict(doc []byte) (any, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	obj := newObject(tm.APIVersion, tm.Kind)
	if obj == nil {
		return nil, fmt.Errorf("unknown apiVersion %q kind %q", tm.APIVersion, tm.Kind)
	}
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return nil, err
	}
	return obj, nil
}

func loadObjects(t *testing.T) []object {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", dir, err)
	}
	var out []object
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range docSep.Split(string(src), -1) {
			if len(bytes.TrimSpace(stripComments([]byte(doc)))) == 0 {
				continue
			}
			obj, err := decodeStrict([]byte(doc))
			if err != nil {
				t.Errorf("%s (document %d): %v", f, i, err)
				continue
			}
			o := object{file: filepath.Base(f), doc: i, obj: obj}
			if m, ok := obj.(metav1.Object); ok {
				o.meta = metav1.ObjectMeta{Name: m.GetName(), Namespace: m.GetNamespace(), Labels: m.GetLabels()}
			}
			out = append(out, o)
		}
	}
	return out
}

func stripComments(b []byte) []byte {
	var out []byte
	for _, l := range bytes.Split(b, []byte("\n")) {
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' {
			out = append(out, l...)
			out = append(out, '\n')
		}
	}
	return out
}

func find[T any](t *testing.T, objs []object, name string) T {
	t.Helper()
	for _, o := range objs {
		if v, ok := o.obj.(T); ok && o.meta.Name == name {
			return v
		}
	}
	var zero T
	t.Fatalf("no %T named %s", zero, name)
	return zero
}

// TestManifestsDecodeStrictly: every document of every manifest decodes
// into its Kubernetes API type with no unknown field, and kustomization.yaml
// lists every manifest but the sidecar example.
func TestManifestsDecodeStrictly(t *testing.T) {
	objs := loadObjects(t)
	if len(objs) < 12 {
		t.Fatalf("only %d objects decoded", len(objs))
	}
	k := find[*kustomization](t, objs, "")
	want := []string{"allocator.yaml", "gateway.yaml", "rules-configmap.yaml"}
	got := slices.Clone(k.Resources)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("kustomization resources = %v, want %v", got, want)
	}
}

// TestStrictDecodeCatchesTypos pins the strictness the manifests test
// relies on: a misspelled field, a field at the wrong level and a value of
// the wrong type are all errors.
func TestStrictDecodeCatchesTypos(t *testing.T) {
	base := `apiVersion: apps/v1
kind: Deployment
metadata: {name: x}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers: [{name: c, image: i}]
`
	if _, err := decodeStrict([]byte(base)); err != nil {
		t.Fatalf("the valid base: %v", err)
	}
	for name, bad := range map[string]string{
		"misspelled":  strings.Replace(base, "containers:", "containres:", 1),
		"wrong level": strings.Replace(base, "  selector:", "  topologySpreadConstraints: []\n  selector:", 1),
		"wrong type":  strings.Replace(base, "metadata: {name: x}", "metadata: {name: x}\n  replicas: two", 1),
		"duplicate":   strings.Replace(base, "metadata: {name: x}", "metadata: {name: x}\nmetadata: {name: y}", 1),
	} {
		if _, err := decodeStrict([]byte(bad)); err == nil {
			t.Errorf("%s: decoded without an error:\n%s", name, bad)
		}
	}
}

// TestAllocatorVotersOnePerNode: the StatefulSet requires (not prefers)
// one allocator per node: two voters on a node would lose the quorum with
// it.
func TestAllocatorVotersOnePerNode(t *testing.T) {
	sts := find[*appsv1.StatefulSet](t, loadObjects(t), "allot-allocator")
	podLabels := labels.Set(sts.Spec.Template.Labels)
	aa := sts.Spec.Template.Spec.Affinity
	if aa == nil || aa.PodAntiAffinity == nil {
		t.Fatal("the allocator StatefulSet has no pod anti-affinity")
	}
	ok := false
	for _, term := range aa.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution {
		sel, err := metav1.LabelSelectorAsSelector(term.LabelSelector)
		if err != nil {
			t.Fatal(err)
		}
		ok = ok || term.TopologyKey == corev1.LabelHostname && sel.Matches(podLabels) && len(term.Namespaces) == 0
	}
	if !ok {
		t.Errorf("no required anti-affinity term on %s selecting the allocator pods: %+v", corev1.LabelHostname, aa.PodAntiAffinity)
	}
	if r := sts.Spec.Replicas; r == nil || *r != 3 {
		t.Errorf("replicas = %v, want 3", r)
	}
	c := sts.Spec.Template.Spec.Containers[0]
	for _, e := range c.Env {
		if e.Name == "REPLICAS" && e.Value != fmt.Sprint(*sts.Spec.Replicas) {
			t.Errorf("env REPLICAS = %q, spec.replicas = %d: keep them equal", e.Value, *sts.Spec.Replicas)
		}
	}
}

// TestGatewaysSpread: the gateway Deployment spreads its replicas over
// nodes (required) and zones.
func TestGatewaysSpread(t *testing.T) {
	dep := find[*appsv1.Deployment](t, loadObjects(t), "allot-gateway")
	podLabels := labels.Set(dep.Spec.Template.Labels)
	keys := map[string]corev1.UnsatisfiableConstraintAction{}
	for _, c := range dep.Spec.Template.Spec.TopologySpreadConstraints {
		sel, err := metav1.LabelSelectorAsSelector(c.LabelSelector)
		if err != nil {
			t.Fatal(err)
		}
		if !sel.Matches(podLabels) || c.MaxSkew != 1 {
			t.Errorf("spread constraint on %s: selector %v, maxSkew %d; want the gateway pods and 1", c.TopologyKey, c.LabelSelector, c.MaxSkew)
		}
		keys[c.TopologyKey] = c.WhenUnsatisfiable
	}
	if keys[corev1.LabelHostname] != corev1.DoNotSchedule {
		t.Errorf("no required spread over %s: %v", corev1.LabelHostname, keys)
	}
	if _, ok := keys[corev1.LabelTopologyZone]; !ok {
		t.Errorf("no spread over %s: %v", corev1.LabelTopologyZone, keys)
	}
}

const (
	grpcPort = 7420
	raftPort = 7421
	httpPort = 7422 // /metrics, /readyz, /debug/pprof/
)

// containerPort resolves a Service or NetworkPolicy port (a number or a
// container port's name) against the allocator container.
func containerPort(c corev1.Container, p intstr.IntOrString) int32 {
	if p.Type == intstr.Int {
		return p.IntVal
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return cp.ContainerPort
		}
	}
	return -1
}

// TestAllocatorHTTPOffServices: no Service exposes the allocators' HTTP
// port (with /debug/pprof/); the ClusterIP Service carries gRPC only.
func TestAllocatorHTTPOffServices(t *testing.T) {
	objs := loadObjects(t)
	sts := find[*appsv1.StatefulSet](t, objs, "allot-allocator")
	c := sts.Spec.Template.Spec.Containers[0]
	podLabels := labels.Set(sts.Spec.Template.Labels)
	for _, o := range objs {
		svc, ok := o.obj.(*corev1.Service)
		if !ok || len(svc.Spec.Selector) == 0 || !labels.SelectorFromSet(svc.Spec.Selector).Matches(podLabels) {
			continue
		}
		for _, p := range svc.Spec.Ports {
			target := p.TargetPort
			if target.Type == intstr.Int && target.IntVal == 0 {
				target = intstr.FromInt32(p.Port)
			}
			if containerPort(c, target) == httpPort {
				t.Errorf("%s: port %s reaches the allocators' HTTP port %d (/debug/pprof/)", o, p.Name, httpPort)
			}
		}
	}
	svc := find[*corev1.Service](t, objs, "allot-allocator")
	if len(svc.Spec.Ports) != 1 || containerPort(c, svc.Spec.Ports[0].TargetPort) != grpcPort {
		t.Errorf("Service allot-allocator ports = %+v, want gRPC %d only", svc.Spec.Ports, grpcPort)
	}
}

// TestAllocatorNetworkPolicy: the allocators admit gRPC from agent pods
// (the gateways carry the label) and gRPC, Raft and HTTP from the other
// members, and nothing else; the only other policy opens the HTTP port to
// a monitoring namespace.
func TestAllocatorNetworkPolicy(t *testing.T) {
	objs := loadObjects(t)
	sts := find[*appsv1.StatefulSet](t, objs, "allot-allocator")
	allocLabels := labels.Set(sts.Spec.Template.Labels)
	gw := find[*appsv1.Deployment](t, objs, "allot-gateway")
	gwLabels := labels.Set(gw.Spec.Template.Labels)
	c := sts.Spec.Template.Spec.Containers[0]

	// admitted lists (peer, port) pairs a policy admits, for a peer given
	// by its pod labels (in some namespace).
	type grant struct {
		peer string
		port int32
	}
	admitted := func(np *networkingv1.NetworkPolicy) map[grant]bool {
		out := map[grant]bool{}
		for _, rule := range np.Spec.Ingress {
			if len(rule.From) == 0 || len(rule.Ports) == 0 {
				t.Errorf("NetworkPolicy %s: an ingress rule without from or ports admits everything: %+v", np.Name, rule)
				continue
			}
			for _, from := range rule.From {
				peer := "other"
				switch {
				case from.IPBlock != nil:
					peer = "ipblock"
				case from.PodSelector != nil && from.NamespaceSelector == nil:
					sel, _ := metav1.LabelSelectorAsSelector(from.PodSelector)
					if sel.Matches(allocLabels) && !sel.Matches(gwLabels) {
						peer = "allocator"
					}
				case from.PodSelector != nil && from.NamespaceSelector != nil:
					sel, _ := metav1.LabelSelectorAsSelector(from.PodSelector)
					if sel.Matches(gwLabels) && !sel.Matches(allocLabels) && !sel.Empty() {
						peer = "agent"
					}
				case from.NamespaceSelector != nil:
					sel, _ := metav1.LabelSelectorAsSelector(from.NamespaceSelector)
					if !sel.Empty() {
						peer = "monitoring"
					}
				}
				for _, p := range rule.Ports {
					if p.Port == nil || p.EndPort != nil {
						t.Errorf("NetworkPolicy %s: a port range or no port: %+v", np.Name, p)
						continue
					}
					out[grant{peer, containerPort(c, *p.Port)}] = true
				}
			}
		}
		return out
	}
	want := map[string]map[grant]bool{
		"allot-allocator": {
			{"agent", grpcPort}:     true,
			{"allocator", grpcPort}: true, {"allocator", raftPort}: true, {"allocator", httpPort}: true,
		},
		"allot-allocator-metrics": {{"monitoring", httpPort}: true},
	}
	seen := 0
	for _, o := range objs {
		np, ok := o.obj.(*networkingv1.NetworkPolicy)
		if !ok {
			continue
		}
		seen++
		sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
		if err != nil || !sel.Matches(allocLabels) || sel.Empty() {
			t.Errorf("%s: does not select the allocator pods alone", o)
		}
		if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) {
			t.Errorf("%s: policyTypes %v, want [Ingress]", o, np.Spec.PolicyTypes)
		}
		w, known := want[np.Name]
		if !known {
			t.Errorf("%s: an unexpected NetworkPolicy", o)
			continue
		}
		got := admitted(np)
		for g := range got {
			if !w[g] {
				t.Errorf("%s admits %s on port %d", o, g.peer, g.port)
			}
		}
		for g := range w {
			if !got[g] {
				t.Errorf("%s does not admit %s on port %d", o, g.peer, g.port)
			}
		}
	}
	if seen != len(want) {
		t.Errorf("%d NetworkPolicies, want %d", seen, len(want))
	}
	// The sidecar example's pods are agents too.
	side := find[*appsv1.Deployment](t, objs, "search-api")
	if side.Spec.Template.Labels["allot.dev/agent"] != "true" || gwLabels["allot.dev/agent"] != "true" {
		t.Error(`the gateway and sidecar pods must carry allot.dev/agent: "true" to reach the allocators`)
	}
}
