package deploy_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
)

// natsEtc is where the configurations and units expect the NATS files:
// the configs (and permissions.conf) in it, the certificates in certs/.
const natsEtc = "/etc/nats/"

var (
	nkeysOnce sync.Once
	nkeysErr  error
)

// setUserNKeys sets the environment permissions.conf reads the users'
// public nkeys from, once for the process (the tests run in parallel, so
// t.Setenv cannot).
func setUserNKeys() error {
	for _, c := range []string{"ENGINE", "WORKER", "CLI"} {
		kp, err := nkeys.CreateUser()
		if err != nil {
			return err
		}
		pub, err := kp.PublicKey()
		if err != nil {
			return err
		}
		if err := os.Setenv("WAYMARK_"+c+"_NKEY", pub); err != nil {
			return err
		}
	}
	return nil
}

// natsTree copies deploy/nats into a fresh directory laid out like
// /etc/nats, with certificates made for the test in certs/, and returns
// that directory (ending in "/"). Paths under /etc/nats/ in the copied
// configs point into it.
func natsTree(t *testing.T) string {
	t.Helper()
	dir := t.TempDir() + "/"
	entries, err := os.ReadDir("nats")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".conf") {
			continue
		}
		data, err := os.ReadFile(filepath.Join("nats", e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		text := strings.ReplaceAll(string(data), natsEtc, dir)
		if err := os.WriteFile(dir+e.Name(), []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	nkeysOnce.Do(func() { nkeysErr = setUserNKeys() })
	if nkeysErr != nil {
		t.Fatal(nkeysErr)
	}
	writeCerts(t, dir+"certs")
	return dir
}

// writeCerts writes a CA and two certificates it signed (server.crt for
// clients, route.crt for routes, both for server and client use) into dir.
func writeCerts(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "waymark test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	writePEM(t, filepath.Join(dir, "ca.crt"), "CERTIFICATE", caDER)
	for i, name := range []string{"server", "route"} {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(int64(i + 2)), Subject: pkix.Name{CommonName: name},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		writePEM(t, filepath.Join(dir, name+".crt"), "CERTIFICATE", der)
		kder, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		writePEM(t, filepath.Join(dir, name+".key"), "EC PRIVATE KEY", kder)
	}
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// loadNATS parses a config of deploy/nats with nats-server's own loader.
func loadNATS(t *testing.T, dir, name string) *server.Options {
	t.Helper()
	opts, err := server.ProcessConfigFile(dir + name)
	if err != nil {
		t.Fatalf("deploy/nats/%s: %v", name, err)
	}
	return opts
}

func accountNames(opts *server.Options) []string {
	var names []string
	for _, a := range opts.Accounts {
		names = append(names, a.Name)
	}
	return names
}

// checkCommon checks what both configs must get right for Waymark.
func checkCommon(t *testing.T, name string, opts *server.Options) {
	t.Helper()
	if !opts.JetStream || opts.StoreDir == "" {
		t.Errorf("%s: JetStream %v, store_dir %q: want JetStream on file storage", name, opts.JetStream, opts.StoreDir)
	}
	if opts.JetStreamMaxStore <= 0 {
		t.Errorf("%s: max_file_store %d: want a limit below the disk's size", name, opts.JetStreamMaxStore)
	}
	if need := int32(kv.Config{}.WithDefaults().MaxMessageBytes); opts.MaxPayload < need {
		t.Errorf("%s: max_payload %d: Waymark's messages reach %d bytes (kv.Config.MaxMessageBytes)", name, opts.MaxPayload, need)
	}
	if opts.TLSConfig == nil || opts.TLSConfig.ClientCAs == nil {
		t.Errorf("%s: want client TLS with a CA", name)
	}
	if opts.ServerName == "" {
		t.Errorf("%s: want a server_name", name)
	}
	if !slices.Contains(accountNames(opts), kedaAccount(t)) {
		t.Errorf("%s: accounts %v: want %q, the account deploy/k8s/keda.yaml reads the work stream in", name, accountNames(opts), kedaAccount(t))
	}
}

func TestNATSClusterConfig(t *testing.T) {
	dir := natsTree(t)
	t.Setenv("NATS_SERVER_NAME", "nats-2")
	opts := loadNATS(t, dir, "cluster.conf")
	checkCommon(t, "cluster.conf", opts)
	if opts.ServerName != "nats-2" {
		t.Errorf("cluster.conf: server_name %q: want it from NATS_SERVER_NAME (nats-2)", opts.ServerName)
	}
	if len(opts.Routes) != 3 {
		t.Errorf("cluster.conf: %d routes: want 3 (every node lists all three)", len(opts.Routes))
	}
	hosts := map[string]bool{}
	for _, r := range opts.Routes {
		hosts[r.Hostname()] = true
		if r.Port() != "6222" {
			t.Errorf("cluster.conf: route %s: want port 6222, the cluster's listen port", r)
		}
	}
	if len(hosts) != 3 {
		t.Errorf("cluster.conf: routes %v: want three distinct hosts", opts.Routes)
	}
	if opts.Cluster.Name == "" || opts.Cluster.Port != 6222 {
		t.Errorf("cluster.conf: cluster name %q port %d: want a name and port 6222", opts.Cluster.Name, opts.Cluster.Port)
	}
	if opts.Cluster.TLSConfig == nil || opts.Cluster.TLSConfig.ClientAuth != tls.RequireAndVerifyClientCert {
		t.Errorf("cluster.conf: want mutual TLS on routes")
	}
	if opts.HTTPPort != kedaMonitorPort(t) {
		t.Errorf("cluster.conf: monitoring port %d: deploy/k8s/keda.yaml reads %d", opts.HTTPPort, kedaMonitorPort(t))
	}
	if opts.LameDuckDuration <= 0 {
		t.Errorf("cluster.conf: want a lame duck duration")
	}
}

func TestNATSSingleConfig(t *testing.T) {
	t.Parallel()
	dir := natsTree(t)
	opts := loadNATS(t, dir, "single.conf")
	checkCommon(t, "single.conf", opts)
	if len(opts.Routes) != 0 || opts.Cluster.Port != 0 {
		t.Errorf("single.conf: routes %v, cluster port %d: want no cluster", opts.Routes, opts.Cluster.Port)
	}
	if !opts.SyncAlways {
		t.Errorf("single.conf: want sync_interval: always (no replica to fall back on)")
	}
	// The config must also start a server, with JetStream on: ports and
	// the store moved to the test's own.
	opts.Port, opts.HTTPPort = -1, -1
	opts.StoreDir = t.TempDir()
	opts.NoSigs = true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("single.conf: new server: %v", err)
	}
	srv.Start()
	defer srv.Shutdown()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("single.conf: server not ready after 10s")
	}
	if !srv.JetStreamEnabled() {
		t.Error("single.conf: JetStream not enabled in the running server")
	}
	acc, err := srv.LookupAccount(kedaAccount(t))
	if err != nil {
		t.Fatalf("single.conf: account %s: %v", kedaAccount(t), err)
	}
	if !acc.JetStreamEnabled() {
		t.Errorf("single.conf: account %s has no JetStream: Waymark's streams and buckets live in it", acc.Name)
	}
}

func TestNATSServerUnitConfig(t *testing.T) {
	// The unit's ExecStart, parsed by nats-server's own command line
	// handling, loads a config that runs a cluster node.
	dir := natsTree(t)
	for k, v := range readEnvFile(t, "systemd/nats.env") {
		if strings.HasSuffix(k, "_NKEY") {
			if !strings.HasSuffix(v, "-PLACEHOLDER") {
				t.Errorf("systemd/nats.env: %s=%q: want a placeholder", k, v)
			}
			continue // a placeholder; natsTree set real public keys
		}
		t.Setenv(k, v)
	}
	argv := execStart(t, "nats-server.service", "")
	if filepath.Base(argv[0]) != "nats-server" {
		t.Fatalf("nats-server.service: ExecStart runs %s", argv[0])
	}
	var args []string
	for _, a := range argv[1:] {
		args = append(args, strings.ReplaceAll(a, natsEtc, dir))
	}
	fs := flag.NewFlagSet("nats-server", flag.ContinueOnError)
	opts, err := server.ConfigureOptions(fs, args, func() {}, func() {}, func() {})
	if err != nil {
		t.Fatalf("nats-server.service: %v", err)
	}
	if !opts.JetStream || len(opts.Routes) != 3 || opts.ServerName != "nats-1" {
		t.Errorf("nats-server.service: JetStream %v, %d routes, name %q: want the cluster config", opts.JetStream, len(opts.Routes), opts.ServerName)
	}
}

// freePort returns a loopback port nothing listens on at the moment.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func TestNATSClusterConfigFormsACluster(t *testing.T) {
	// Three servers from cluster.conf, as parsed (TLS on clients and
	// routes, JetStream, accounts), on loopback: only the addresses and
	// the store are moved. The routes must come up over mutual TLS.
	dir := natsTree(t)
	t.Setenv("NATS_SERVER_NAME", "nats-1")
	ports := []int{freePort(t), freePort(t), freePort(t)}
	var servers []*server.Server
	for i := range ports {
		opts := loadNATS(t, dir, "cluster.conf")
		opts.ServerName = "nats-" + string(rune('1'+i))
		opts.Host, opts.Port, opts.HTTPPort = "127.0.0.1", -1, -1
		opts.Cluster.Host, opts.Cluster.Port = "127.0.0.1", ports[i]
		opts.Routes = nil
		for _, p := range ports {
			opts.Routes = append(opts.Routes, server.RoutesFromStr("nats-route://127.0.0.1:"+strconv.Itoa(p))...)
		}
		opts.StoreDir = t.TempDir()
		opts.NoSigs, opts.NoLog = true, true
		srv, err := server.NewServer(opts)
		if err != nil {
			t.Fatalf("cluster.conf node %d: %v", i+1, err)
		}
		servers = append(servers, srv)
		go srv.Start()
		defer srv.Shutdown()
	}
	for _, srv := range servers {
		// NumRemotes counts the other servers (NumRoutes counts pooled
		// connections, several per server).
		testsupport.Eventually(t, 10*time.Second, func() bool { return srv.NumRemotes() == len(servers)-1 },
			"cluster.conf: %s is not routed to the %d other servers (routes over mutual TLS)", srv.Name(), len(servers)-1)
		if !srv.JetStreamEnabled() {
			t.Errorf("cluster.conf: %s: JetStream not enabled", srv.Name())
		}
	}
}
