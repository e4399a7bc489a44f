package deploy_test

import (
	"os"
	"path"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
)

// The Helm release deploy/k8s and the README assume: release "nats" in
// namespace "nats", so the chart names its client Service "nats" and its
// headless Service "nats-headless".
const (
	helmClientHost   = "nats.nats.svc.cluster.local"
	helmHeadlessHost = "nats-headless.nats.svc.cluster.local"
	// helmConfigDir is where the chart mounts its nats.conf; $include
	// paths are relative to it.
	helmConfigDir = "/etc/nats-config"
)

// helmTLS mirrors a `tls` block of the nats chart's values.
type helmTLS struct {
	Enabled    bool   `json:"enabled"`
	SecretName string `json:"secretName,omitempty"`
	Dir        string `json:"dir,omitempty"`
	Cert       string `json:"cert,omitempty"`
	Key        string `json:"key,omitempty"`
}

// jsonPatchOp is one JSON patch operation, as the chart's `patch` lists
// take them.
type jsonPatchOp struct {
	Op    string         `json:"op"`
	Path  string         `json:"path"`
	Value map[string]any `json:"value,omitempty"`
}

// helmValues mirrors the keys of the nats chart's values.yaml
// (nats-io/k8s helm/charts/nats, 2.14.2) that nats-values.yaml sets, in
// the chart's structure; strict decoding refuses a key that is not here,
// so a misspelt or misplaced key fails.
type helmValues struct {
	Config struct {
		Cluster struct {
			Enabled  bool    `json:"enabled"`
			Port     int     `json:"port,omitempty"`
			Replicas int     `json:"replicas"`
			TLS      helmTLS `json:"tls"`
		} `json:"cluster"`
		JetStream struct {
			Enabled   bool `json:"enabled"`
			FileStore struct {
				Enabled bool   `json:"enabled"`
				Dir     string `json:"dir,omitempty"`
				PVC     struct {
					Enabled          bool   `json:"enabled"`
					Size             string `json:"size"`
					StorageClassName string `json:"storageClassName,omitempty"`
				} `json:"pvc"`
				MaxSize string `json:"maxSize,omitempty"`
			} `json:"fileStore"`
			MemoryStore struct {
				Enabled bool   `json:"enabled"`
				MaxSize string `json:"maxSize,omitempty"`
			} `json:"memoryStore"`
		} `json:"jetstream"`
		Nats struct {
			Port int     `json:"port"`
			TLS  helmTLS `json:"tls"`
		} `json:"nats"`
		Monitor struct {
			Enabled bool `json:"enabled"`
			Port    int  `json:"port"`
		} `json:"monitor"`
		Merge map[string]any `json:"merge,omitempty"`
	} `json:"config"`
	TLSCA struct {
		Enabled    bool   `json:"enabled"`
		SecretName string `json:"secretName,omitempty"`
		Key        string `json:"key,omitempty"`
	} `json:"tlsCA"`
	Container struct {
		Env       map[string]string `json:"env,omitempty"`
		Resources struct {
			Requests map[string]resource.Quantity `json:"requests,omitempty"`
			Limits   map[string]resource.Quantity `json:"limits,omitempty"`
		} `json:"resources"`
		Patch []jsonPatchOp `json:"patch,omitempty"`
	} `json:"container"`
	PodTemplate struct {
		TopologySpreadConstraints map[string]struct {
			MaxSkew           int    `json:"maxSkew"`
			WhenUnsatisfiable string `json:"whenUnsatisfiable,omitempty"`
		} `json:"topologySpreadConstraints,omitempty"`
		Patch []jsonPatchOp `json:"patch,omitempty"`
	} `json:"podTemplate"`
	PodDisruptionBudget struct {
		Enabled bool `json:"enabled"`
	} `json:"podDisruptionBudget"`
	NatsBox struct {
		Enabled bool `json:"enabled"`
	} `json:"natsBox"`
}

func loadHelmValues(t *testing.T) *helmValues {
	t.Helper()
	data, err := os.ReadFile("helm/nats-values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	v := &helmValues{}
	if err := decodeStrict("deploy/helm/nats-values.yaml", data, v); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestHelmValues(t *testing.T) {
	t.Parallel()
	v := loadHelmValues(t)
	c := v.Config
	if !c.Cluster.Enabled || c.Cluster.Replicas != 3 {
		t.Errorf("cluster enabled %v replicas %d: want a 3-node cluster", c.Cluster.Enabled, c.Cluster.Replicas)
	}
	if !c.JetStream.Enabled || !c.JetStream.FileStore.Enabled || !c.JetStream.FileStore.PVC.Enabled {
		t.Errorf("want JetStream on file storage in a PersistentVolumeClaim")
	}
	if q, err := resource.ParseQuantity(c.JetStream.FileStore.PVC.Size); err != nil || q.Sign() <= 0 {
		t.Errorf("jetstream.fileStore.pvc.size %q: want a size (%v)", c.JetStream.FileStore.PVC.Size, err)
	}
	if c.JetStream.MemoryStore.Enabled {
		if _, err := resource.ParseQuantity(c.JetStream.MemoryStore.MaxSize); err != nil {
			t.Errorf("jetstream.memoryStore.maxSize %q: %v", c.JetStream.MemoryStore.MaxSize, err)
		}
	}
	for name, tls := range map[string]helmTLS{"nats": c.Nats.TLS, "cluster": c.Cluster.TLS} {
		if !tls.Enabled || tls.SecretName == "" {
			t.Errorf("config.%s.tls: want TLS from a Secret", name)
		}
	}
	if !v.TLSCA.Enabled || v.TLSCA.SecretName == "" {
		t.Errorf("tlsCA: want the CA from a Secret (routes verify each other's certificates with it)")
	}
	if c.Merge["max_payload"] != any("<< 8MB >>") {
		t.Errorf("config.merge.max_payload %q: want << 8MB >> (unquoted by the chart), as deploy/nats/cluster.conf", c.Merge["max_payload"])
	}
	// The accounts come from deploy/nats/permissions.conf, mounted from a
	// ConfigMap: the include must land in the mounted directory.
	inc, _ := c.Merge["$include"].(string)
	accounts, _ := c.Merge["accounts"].(map[string]any)
	account, _ := accounts[kedaAccount(t)].(map[string]any)
	if account["jetstream"] != "enabled" || account["users"] != "<< $WAYMARK_USERS >>" {
		t.Errorf("config.merge.accounts.%s %v: want jetstream enabled and users << $WAYMARK_USERS >> (from permissions.conf)", kedaAccount(t), account)
	}
	for _, c := range []string{"ENGINE", "WORKER", "CLI"} {
		if v.Container.Env["WAYMARK_"+c+"_NKEY"] == "" {
			t.Errorf("container.env: want WAYMARK_%s_NKEY, the public nkey permissions.conf reads", c)
		}
	}
	if path.Base(inc) != "permissions.conf" {
		t.Fatalf("config.merge.$include %q: want deploy/nats/permissions.conf", inc)
	}
	incPath := path.Join(helmConfigDir, inc)
	var mountName string
	for _, op := range v.Container.Patch {
		if op.Op == "add" && op.Path == "/volumeMounts/-" {
			if mp, _ := op.Value["mountPath"].(string); strings.HasPrefix(incPath, strings.TrimSuffix(mp, "/")+"/") {
				mountName, _ = op.Value["name"].(string)
			}
		}
	}
	if mountName == "" {
		t.Fatalf("config.merge.$include resolves to %s, in no volume container.patch mounts", incPath)
	}
	var volume bool
	for _, op := range v.PodTemplate.Patch {
		if op.Op == "add" && op.Path == "/spec/volumes/-" && op.Value["name"] == mountName {
			cm, _ := op.Value["configMap"].(map[string]any)
			volume = cm != nil && cm["name"] != ""
		}
	}
	if !volume {
		t.Errorf("podTemplate.patch: want a ConfigMap volume %q for the mount of permissions.conf", mountName)
	}
	if lim, ok := v.Container.Resources.Limits["memory"]; ok && c.JetStream.MemoryStore.Enabled {
		ms := resource.MustParse(c.JetStream.MemoryStore.MaxSize)
		if lim.Cmp(ms) <= 0 {
			t.Errorf("container memory limit %s: want it above jetstream.memoryStore.maxSize %s", lim.String(), ms.String())
		}
	}
}
