package deploy_test

import (
	"bytes"
	"fmt"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/internal/cliflags"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/steps"
)

// Stop bounds, from the code: what a process may still do after SIGTERM.
const (
	// engineHTTPShutdown is how long engine serve waits for HTTP requests
	// in flight (internal/cli/serve.go).
	engineHTTPShutdown = 5 * time.Second
	// connDrain is the NATS connection's flush (2s) and drain (5s) at a
	// stop (internal/cli/run.go, stack.stop).
	connDrain = 7 * time.Second
)

// workerStopBound is the longest a worker under the default
// --drain-timeout runs after SIGTERM: the pull in flight ends, the steps
// in hand drain.
var workerStopBound = steps.DefaultFetchWait + steps.DefaultDrainTimeout

// engineStopBound is the longest engine serve runs after SIGTERM: the
// HTTP API's shutdown, the engine's inbox batches (its publish timeout),
// the connection's drain.
var engineStopBound = engineHTTPShutdown + engine.DefaultPublishTimeout + connDrain

// scaledObject mirrors the fields of KEDA's keda.sh/v1alpha1 ScaledObject
// that keda.yaml uses (KEDA's Go module is too heavy to import); strict
// decoding refuses any other.
type scaledObject struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		ScaleTargetRef struct {
			APIVersion string `json:"apiVersion,omitempty"`
			Kind       string `json:"kind,omitempty"`
			Name       string `json:"name"`
		} `json:"scaleTargetRef"`
		PollingInterval *int32 `json:"pollingInterval,omitempty"`
		CooldownPeriod  *int32 `json:"cooldownPeriod,omitempty"`
		MinReplicaCount *int32 `json:"minReplicaCount,omitempty"`
		MaxReplicaCount *int32 `json:"maxReplicaCount,omitempty"`
		Triggers        []struct {
			Type     string            `json:"type"`
			Metadata map[string]string `json:"metadata"`
		} `json:"triggers"`
	} `json:"spec"`
}

// natsJetStreamKeys are the nats-jetstream scaler's metadata keys (KEDA's
// scaler documentation, v2.8 and later), true for the required ones.
var natsJetStreamKeys = map[string]bool{
	"natsServerMonitoringEndpoint": true,
	"account":                      true,
	"stream":                       true,
	"consumer":                     true,
	"lagThreshold":                 true,
	"activationLagThreshold":       false,
	"useHttps":                     false,
}

// manifests holds every document of every file in deploy/k8s, decoded.
type manifests struct {
	deployments []*appsv1.Deployment
	services    []*corev1.Service
	secrets     []*corev1.Secret
	scaled      []*scaledObject
	docs        int
}

// splitYAML splits a multi-document YAML file on its "---" lines.
func splitYAML(data []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	flush := func() {
		if len(bytes.TrimSpace(stripComments(cur.Bytes()))) > 0 {
			docs = append(docs, slices.Clone(cur.Bytes()))
		}
		cur.Reset()
	}
	for _, line := range bytes.SplitAfter(data, []byte("\n")) {
		if string(bytes.TrimRight(line, "\r\n")) == "---" {
			flush()
			continue
		}
		cur.Write(line)
	}
	flush()
	return docs
}

func stripComments(doc []byte) []byte {
	var out []byte
	for _, line := range bytes.SplitAfter(doc, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(line), []byte("#")) {
			out = append(out, line...)
		}
	}
	return out
}

// decodeStrict decodes one document into v, refusing unknown and
// duplicate fields.
func decodeStrict(where string, doc []byte, v any) error {
	if err := yaml.UnmarshalStrict(doc, v); err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	return nil
}

// loadManifests decodes every document of every YAML file in deploy/k8s
// into its k8s.io/api type, by apiVersion and kind; a kind it does not
// know fails.
func loadManifests(t *testing.T) *manifests {
	t.Helper()
	files, err := filepath.Glob("k8s/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("deploy/k8s: no manifests (%v)", err)
	}
	m := &manifests{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range splitYAML(data) {
			where := fmt.Sprintf("deploy/%s, document %d", f, i+1)
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal(doc, &tm); err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			var obj any
			switch tm.APIVersion + " " + tm.Kind {
			case "apps/v1 Deployment":
				d := &appsv1.Deployment{}
				m.deployments, obj = append(m.deployments, d), d
			case "v1 Service":
				s := &corev1.Service{}
				m.services, obj = append(m.services, s), s
			case "v1 Secret":
				s := &corev1.Secret{}
				m.secrets, obj = append(m.secrets, s), s
			case "v1 Namespace":
				obj = &corev1.Namespace{}
			case "v1 ConfigMap":
				obj = &corev1.ConfigMap{}
			case "policy/v1 PodDisruptionBudget":
				obj = &policyv1.PodDisruptionBudget{}
			case "keda.sh/v1alpha1 ScaledObject":
				s := &scaledObject{}
				m.scaled, obj = append(m.scaled, s), s
			default:
				t.Fatalf("%s: apiVersion %q kind %q: not a kind this test decodes (add it)", where, tm.APIVersion, tm.Kind)
			}
			if err := decodeStrict(where, doc, obj); err != nil {
				t.Fatal(err)
			}
			m.docs++
		}
	}
	return m
}

func (m *manifests) secret(ns, name string) *corev1.Secret {
	for _, s := range m.secrets {
		if s.Namespace == ns && s.Name == name {
			return s
		}
	}
	return nil
}

func (m *manifests) deployment(ns, name string) *appsv1.Deployment {
	for _, d := range m.deployments {
		if d.Namespace == ns && d.Name == name {
			return d
		}
	}
	return nil
}

func secretKeys(s *corev1.Secret) []string {
	var keys []string
	for k := range s.StringData {
		keys = append(keys, k)
	}
	for k := range s.Data {
		keys = append(keys, k)
	}
	return keys
}

func TestStrictDecodingRefusesUnknownField(t *testing.T) {
	t.Parallel()
	doc := []byte("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replica: 2\n")
	if err := decodeStrict("test", doc, &appsv1.Deployment{}); err == nil {
		t.Fatal("a misspelt field (replica) decoded; want an error")
	}
}

func TestManifests(t *testing.T) {
	t.Parallel()
	m := loadManifests(t)
	if len(m.deployments) < 2 || len(m.scaled) == 0 {
		t.Fatalf("deploy/k8s: %d deployments, %d scaled objects: want the engine's, a worker pool's and its ScaledObject", len(m.deployments), len(m.scaled))
	}
	binaries := map[string]int{}
	layoutEnv := map[string]map[string]string{}
	for _, d := range m.deployments {
		where := "deployment " + d.Name
		checkSelector(t, where, d)
		spec := d.Spec.Template.Spec
		psc := spec.SecurityContext
		if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
			t.Errorf("%s: want securityContext.runAsNonRoot", where)
		}
		if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
			t.Errorf("%s: want automountServiceAccountToken: false (Waymark does not call the Kubernetes API)", where)
		}
		volumes := map[string]corev1.Volume{}
		for _, v := range spec.Volumes {
			volumes[v.Name] = v
			if v.Secret != nil {
				s := m.secret(d.Namespace, v.Secret.SecretName)
				if s == nil && (v.Secret.Optional == nil || !*v.Secret.Optional) {
					t.Errorf("%s: volume %s: Secret %s/%s is not in deploy/k8s/secrets.yaml", where, v.Name, d.Namespace, v.Secret.SecretName)
				}
			}
		}
		if len(spec.Containers) != 1 {
			t.Fatalf("%s: %d containers: want 1", where, len(spec.Containers))
		}
		c := spec.Containers[0]
		where += ", container " + c.Name
		csc := c.SecurityContext
		if csc == nil || csc.ReadOnlyRootFilesystem == nil || !*csc.ReadOnlyRootFilesystem ||
			csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation ||
			csc.Capabilities == nil || !slices.Contains(csc.Capabilities.Drop, corev1.Capability("ALL")) {
			t.Errorf("%s: want readOnlyRootFilesystem, allowPrivilegeEscalation false, capabilities drop ALL", where)
		}
		for _, vm := range c.VolumeMounts {
			if _, ok := volumes[vm.Name]; !ok {
				t.Errorf("%s: volumeMount %s names no volume", where, vm.Name)
			}
		}
		for _, e := range c.Env {
			if ref := e.ValueFrom; ref != nil && ref.SecretKeyRef != nil {
				s := m.secret(d.Namespace, ref.SecretKeyRef.Name)
				optional := ref.SecretKeyRef.Optional != nil && *ref.SecretKeyRef.Optional
				if !optional && (s == nil || !slices.Contains(secretKeys(s), ref.SecretKeyRef.Key)) {
					t.Errorf("%s: env %s: key %s of Secret %s is not in secrets.yaml", where, e.Name, ref.SecretKeyRef.Key, ref.SecretKeyRef.Name)
				}
			}
		}
		cl := parseCommandLine(t, where, append(slices.Clone(c.Command), c.Args...))
		binaries[cl.binary]++
		checkFilePaths(t, where, cl, c, volumes, m, d.Namespace)
		checkNATSURL(t, where, cl)
		env := map[string]string{}
		for _, e := range c.Env {
			if strings.HasPrefix(e.Name, "WAYMARK_") && e.ValueFrom == nil {
				env[e.Name] = e.Value
			}
		}
		layoutEnv[where] = env
		grace := time.Duration(0)
		if spec.TerminationGracePeriodSeconds != nil {
			grace = time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
		}
		var preStop time.Duration
		if c.Lifecycle != nil && c.Lifecycle.PreStop != nil && c.Lifecycle.PreStop.Sleep != nil {
			preStop = time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
		}
		switch cl.binary {
		case "engine":
			if cl.cmd.Name() != "serve" {
				t.Errorf("%s: runs engine %s: want engine serve", where, cl.cmd.Name())
			}
			if cl.value("workers") != "0" {
				t.Errorf("%s: --workers %s: want 0 (steps run in the worker Deployments)", where, cl.value("workers"))
			}
			if need := engineStopBound + preStop; grace < need {
				t.Errorf("%s: terminationGracePeriodSeconds %v: engine serve may take %v to stop (HTTP %v, inbox batches %v, connection %v, preStop %v)",
					where, grace, need, engineHTTPShutdown, engine.DefaultPublishTimeout, connDrain, preStop)
			}
			port := listenPort(t, where, "http", cl.value("http"))
			checkProbes(t, where, c, port, cl.given("http-tlscert"))
		case "worker":
			drain, err := time.ParseDuration(cl.value("drain-timeout"))
			if err != nil {
				t.Fatalf("%s: --drain-timeout: %v", where, err)
			}
			if need := steps.DefaultFetchWait + drain; grace < need {
				t.Errorf("%s: terminationGracePeriodSeconds %v: a worker may take %v to stop (pull %v, --drain-timeout %v)", where, grace, need, steps.DefaultFetchWait, drain)
			}
			if !cl.given("metrics") {
				t.Fatalf("%s: no --metrics: the probes need the worker's /healthz and /readyz", where)
			}
			port := listenPort(t, where, "metrics", cl.value("metrics"))
			checkProbes(t, where, c, port, false)
			if pool, ok := d.Labels["waymark.dev/pool"]; ok && pool != cl.value("pool") {
				t.Errorf("%s: label waymark.dev/pool %q, --pool %q", where, pool, cl.value("pool"))
			}
		}
	}
	if binaries["engine"] == 0 || binaries["worker"] == 0 {
		t.Errorf("deploy/k8s: command lines of %v: want an engine and a worker", binaries)
	}
	checkLayoutEnv(t, layoutEnv)
	for _, so := range m.scaled {
		checkScaledObject(t, m, so)
	}
}

// checkSelector checks the Deployment's selector picks its own pods.
func checkSelector(t *testing.T, where string, d *appsv1.Deployment) {
	t.Helper()
	if d.Spec.Selector == nil || len(d.Spec.Selector.MatchLabels) == 0 {
		t.Errorf("%s: no selector", where)
		return
	}
	for k, v := range d.Spec.Selector.MatchLabels {
		if d.Spec.Template.Labels[k] != v {
			t.Errorf("%s: selector %s=%s does not match the pod template's labels", where, k, v)
		}
	}
}

// checkProbes checks the readiness (/readyz) and liveness (/healthz)
// probes ask the port the command line listens on, over HTTPS when it
// serves TLS.
func checkProbes(t *testing.T, where string, c corev1.Container, port int, https bool) {
	t.Helper()
	for _, p := range []struct {
		kind  string
		probe *corev1.Probe
		path  string
	}{{"readinessProbe", c.ReadinessProbe, "/readyz"}, {"livenessProbe", c.LivenessProbe, "/healthz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s: want an HTTP %s on %s", where, p.kind, p.path)
			continue
		}
		g := p.probe.HTTPGet
		if g.Path != p.path {
			t.Errorf("%s: %s path %q: want %s", where, p.kind, g.Path, p.path)
		}
		if got := resolvePort(t, where, c, g.Port); got != port {
			t.Errorf("%s: %s on port %d: the process listens on %d", where, p.kind, got, port)
		}
		want := corev1.URISchemeHTTP
		if https {
			want = corev1.URISchemeHTTPS
		}
		if got := g.Scheme; got != want && !(got == "" && want == corev1.URISchemeHTTP) {
			t.Errorf("%s: %s scheme %q: want %s", where, p.kind, got, want)
		}
	}
}

func resolvePort(t *testing.T, where string, c corev1.Container, p intstr.IntOrString) int {
	t.Helper()
	if p.Type == intstr.Int {
		return p.IntValue()
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return int(cp.ContainerPort)
		}
	}
	t.Errorf("%s: port %q names no container port", where, p.StrVal)
	return -1
}

// checkFilePaths checks every file the command line reads is in a mounted
// volume, and, in a Secret volume, is a key of that Secret.
func checkFilePaths(t *testing.T, where string, cl *commandLine, c corev1.Container, volumes map[string]corev1.Volume, m *manifests, ns string) {
	t.Helper()
	for _, name := range fileFlags {
		if !cl.given(name) {
			continue
		}
		p := path.Clean(cl.value(name))
		var mount *corev1.VolumeMount
		for i, vm := range c.VolumeMounts {
			if p == vm.MountPath || strings.HasPrefix(p, strings.TrimSuffix(vm.MountPath, "/")+"/") {
				mount = &c.VolumeMounts[i]
			}
		}
		if mount == nil {
			t.Errorf("%s: --%s %s is in no mounted volume", where, name, p)
			continue
		}
		v := volumes[mount.Name]
		if v.Secret == nil || p == mount.MountPath {
			continue
		}
		key := strings.SplitN(strings.TrimPrefix(p, strings.TrimSuffix(mount.MountPath, "/")+"/"), "/", 2)[0]
		if s := m.secret(ns, v.Secret.SecretName); s != nil && !slices.Contains(secretKeys(s), key) {
			t.Errorf("%s: --%s %s: Secret %s has no key %q (it has %v)", where, name, p, s.Name, key, secretKeys(s))
		}
	}
}

// checkNATSURL checks the server URL names the NATS Helm release's
// client Service and port, over TLS as the values configure it.
func checkNATSURL(t *testing.T, where string, cl *commandLine) {
	t.Helper()
	v := loadHelmValues(t)
	for _, s := range strings.Split(cl.value("nats-url"), ",") {
		u, err := url.Parse(s)
		if err != nil {
			t.Errorf("%s: --server %q: %v", where, s, err)
			continue
		}
		wantScheme := "nats"
		if v.Config.Nats.TLS.Enabled {
			wantScheme = "tls"
		}
		if u.Scheme != wantScheme {
			t.Errorf("%s: --server %s: want %s:// (client TLS is %v in the Helm values)", where, s, wantScheme, v.Config.Nats.TLS.Enabled)
		}
		if u.Hostname() != helmClientHost || u.Port() != strconv.Itoa(v.Config.Nats.Port) {
			t.Errorf("%s: --server %s: want %s:%d, the Helm release's client Service", where, s, helmClientHost, v.Config.Nats.Port)
		}
	}
}

// checkLayoutEnv checks every process sets the same WAYMARK_* layout
// values and that the settings' own parser takes them.
func checkLayoutEnv(t *testing.T, envs map[string]map[string]string) {
	t.Helper()
	var first string
	var want map[string]string
	for where, env := range envs {
		layout := map[string]string{}
		for k, v := range env {
			if k != "WAYMARK_POOL" && k != "WAYMARK_WORKER_METRICS" {
				layout[k] = v
			}
		}
		if want == nil {
			first, want = where, layout
			continue
		}
		if fmt.Sprint(layout) != fmt.Sprint(want) {
			t.Errorf("%s: layout env %v, %s: %v: every process of a deployment must share them", where, layout, first, want)
		}
	}
}

// checkLayoutValues parses each WAYMARK_* variable with the settings' own
// parser (cliflags.KVConfigFromEnv), one at a time. It sets the process
// environment, so its test must not be parallel.
func checkLayoutValues(t *testing.T, where string, env map[string]string) {
	t.Helper()
	for k, v := range env {
		t.Setenv(k, v)
		if _, err := cliflags.KVConfigFromEnv(kv.Config{}); err != nil {
			t.Errorf("%s: %v", where, err)
		}
		t.Setenv(k, "")
	}
}

func TestLayoutEnv(t *testing.T) {
	m := loadManifests(t)
	for _, d := range m.deployments {
		env := map[string]string{}
		for _, e := range d.Spec.Template.Spec.Containers[0].Env {
			if strings.HasPrefix(e.Name, "WAYMARK_") && e.ValueFrom == nil {
				env[e.Name] = e.Value
			}
		}
		checkLayoutValues(t, "deployment "+d.Name, env)
	}
	env := readEnvFile(t, "systemd/waymark.env")
	checkLayoutValues(t, "deploy/systemd/waymark.env", env)
	// The units and the manifests describe one deployment each; their
	// layouts should not drift apart.
	for _, d := range m.deployments {
		for _, e := range d.Spec.Template.Spec.Containers[0].Env {
			if v, ok := env[e.Name]; ok && v != e.Value {
				t.Errorf("deployment %s: %s=%q, deploy/systemd/waymark.env: %q", d.Name, e.Name, e.Value, v)
			}
		}
	}
}

// checkScaledObject checks a KEDA ScaledObject scales a worker Deployment
// on its pool's consumer, through the Helm release's monitoring endpoint.
func checkScaledObject(t *testing.T, m *manifests, so *scaledObject) {
	t.Helper()
	where := "ScaledObject " + so.Metadata.Name
	d := m.deployment(so.Metadata.Namespace, so.Spec.ScaleTargetRef.Name)
	if d == nil {
		t.Fatalf("%s: scaleTargetRef %s/%s is no Deployment in deploy/k8s", where, so.Metadata.Namespace, so.Spec.ScaleTargetRef.Name)
	}
	c := d.Spec.Template.Spec.Containers[0]
	cl := parseCommandLine(t, where+" target", append(slices.Clone(c.Command), c.Args...))
	if cl.binary != "worker" {
		t.Fatalf("%s: scales %s, which runs %s: want a worker Deployment", where, d.Name, cl.binary)
	}
	if len(so.Spec.Triggers) != 1 || so.Spec.Triggers[0].Type != "nats-jetstream" {
		t.Fatalf("%s: want one nats-jetstream trigger", where)
	}
	md := so.Spec.Triggers[0].Metadata
	for k := range md {
		if _, ok := natsJetStreamKeys[k]; !ok {
			t.Errorf("%s: metadata %q is not a key of the nats-jetstream scaler", where, k)
		}
	}
	for k, required := range natsJetStreamKeys {
		if _, ok := md[k]; required && !ok {
			t.Errorf("%s: metadata %q missing", where, k)
		}
	}
	names := kv.NamesFor(cl.value("prefix"))
	if md["stream"] != names.WorkStream {
		t.Errorf("%s: stream %q: the work stream is %s", where, md["stream"], names.WorkStream)
	}
	if want := names.WorkConsumer(cl.value("pool")); md["consumer"] != want {
		t.Errorf("%s: consumer %q: pool %q's consumer is %s", where, md["consumer"], cl.value("pool"), want)
	}
	for _, k := range []string{"lagThreshold", "activationLagThreshold"} {
		if s, ok := md[k]; ok {
			if n, err := strconv.Atoi(s); err != nil || n < 1 {
				t.Errorf("%s: %s %q: want a positive integer", where, k, s)
			}
		}
	}
	v := loadHelmValues(t)
	host, port, err := net.SplitHostPort(md["natsServerMonitoringEndpoint"])
	if err != nil {
		t.Fatalf("%s: natsServerMonitoringEndpoint: %v", where, err)
	}
	if host != helmHeadlessHost {
		t.Errorf("%s: endpoint host %s: want %s, the headless Service, so the scaler reaches each node and reads the consumer's leader", where, host, helmHeadlessHost)
	}
	if port != strconv.Itoa(v.Config.Monitor.Port) || !v.Config.Monitor.Enabled {
		t.Errorf("%s: endpoint port %s: the Helm values monitor on %d (enabled %v)", where, port, v.Config.Monitor.Port, v.Config.Monitor.Enabled)
	}
	if md["useHttps"] == "true" {
		t.Errorf("%s: useHttps true, but the Helm values monitor over HTTP", where)
	}
	if so.Spec.MinReplicaCount != nil && so.Spec.MaxReplicaCount != nil && *so.Spec.MinReplicaCount > *so.Spec.MaxReplicaCount {
		t.Errorf("%s: minReplicaCount above maxReplicaCount", where)
	}
}

// kedaTrigger returns the metadata of keda.yaml's trigger.
func kedaTrigger(t *testing.T) map[string]string {
	t.Helper()
	data, err := os.ReadFile("k8s/keda.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var so scaledObject
	if err := decodeStrict("deploy/k8s/keda.yaml", data, &so); err != nil {
		t.Fatal(err)
	}
	if len(so.Spec.Triggers) == 0 {
		t.Fatal("deploy/k8s/keda.yaml: no trigger")
	}
	return so.Spec.Triggers[0].Metadata
}

// kedaAccount is the NATS account keda.yaml reads the work stream in.
func kedaAccount(t *testing.T) string { return kedaTrigger(t)["account"] }

// kedaMonitorPort is the monitoring port keda.yaml reads.
func kedaMonitorPort(t *testing.T) int {
	_, p, err := net.SplitHostPort(kedaTrigger(t)["natsServerMonitoringEndpoint"])
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(p)
	return n
}
