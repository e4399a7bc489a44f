package deploy_test

import (
	"bufio"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-systemd/v22/unit"
)

// loadUnit parses a unit file of deploy/systemd with go-systemd.
func loadUnit(t *testing.T, name string) []*unit.UnitOption {
	t.Helper()
	f, err := os.Open(filepath.Join("systemd", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	opts, err := unit.Deserialize(f)
	if err != nil {
		t.Fatalf("deploy/systemd/%s: %v", name, err)
	}
	return opts
}

// unitValues returns the values of section.name, in order.
func unitValues(opts []*unit.UnitOption, section, name string) []string {
	var vs []string
	for _, o := range opts {
		if o.Section == section && o.Name == name {
			vs = append(vs, o.Value)
		}
	}
	return vs
}

func unitValue(t *testing.T, where string, opts []*unit.UnitOption, section, name string) string {
	t.Helper()
	vs := unitValues(opts, section, name)
	if len(vs) != 1 {
		t.Errorf("%s: %d %s.%s: want one", where, len(vs), section, name)
		return ""
	}
	return vs[0]
}

// expandSpecifiers expands the unit specifiers the units use: %i (the
// instance), %d (the credentials directory), %% ; any other fails.
func expandSpecifiers(t *testing.T, where, name, instance, s string) string {
	t.Helper()
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b.WriteByte(s[i])
			continue
		}
		if i+1 >= len(s) {
			t.Fatalf("%s: a lone %% in %q", where, s)
		}
		i++
		switch s[i] {
		case 'i':
			if instance == "" {
				t.Fatalf("%s: %%i in a unit that is not a template", where)
			}
			b.WriteString(instance)
		case 'd':
			unitName := strings.Replace(name, "@.", "@"+instance+".", 1)
			b.WriteString("/run/credentials/" + unitName)
		case '%':
			b.WriteByte('%')
		default:
			t.Fatalf("%s: specifier %%%c: the test does not expand it (add it)", where, s[i])
		}
	}
	return b.String()
}

// execStart returns the unit's ExecStart command line with its
// specifiers expanded (instance for %i).
func execStart(t *testing.T, name, instance string) []string {
	t.Helper()
	opts := loadUnit(t, name)
	where := "deploy/systemd/" + name
	line := unitValue(t, where, opts, "Service", "ExecStart")
	if strings.ContainsAny(line, `"'\$`) {
		t.Fatalf("%s: ExecStart %q: quoting and variables are not expanded by this test; keep the line plain", where, line)
	}
	return strings.Fields(expandSpecifiers(t, where, name, instance, line))
}

// readEnvFile reads a KEY=VALUE file as systemd's EnvironmentFile does
// (comments and blank lines skipped; no quoting used).
func readEnvFile(t *testing.T, name string) map[string]string {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || k == "" {
			t.Fatalf("deploy/%s:%d: want KEY=VALUE", name, n)
		}
		env[k] = v
	}
	return env
}

// hardening are settings every unit must have (modelled on nats-server's
// own unit).
var hardening = map[string]string{
	"NoNewPrivileges":       "yes",
	"ProtectSystem":         "strict",
	"ProtectHome":           "yes",
	"PrivateTmp":            "yes",
	"PrivateDevices":        "yes",
	"ProtectKernelTunables": "yes",
	"ProtectControlGroups":  "yes",
	"RestrictSUIDSGID":      "yes",
	"CapabilityBoundingSet": "",
}

func TestSystemdUnits(t *testing.T) {
	for _, tc := range []struct {
		unit       string
		instance   string
		killSignal string
		stopBound  time.Duration
	}{
		{"waymark-engine.service", "", "SIGTERM", engineStopBound},
		{"waymark-worker@.service", "default", "SIGTERM", workerStopBound},
		// lame_duck_grace_period plus lame_duck_duration of deploy/nats.
		{"nats-server.service", "", "SIGUSR2", 40 * time.Second},
	} {
		t.Run(tc.unit, func(t *testing.T) {
			where := "deploy/systemd/" + tc.unit
			opts := loadUnit(t, tc.unit)
			for _, sec := range []string{"Unit", "Service", "Install"} {
				found := false
				for _, o := range opts {
					found = found || o.Section == sec
				}
				if !found {
					t.Errorf("%s: no [%s] section", where, sec)
				}
			}
			if v := unitValue(t, where, opts, "Service", "Type"); v != "exec" && v != "simple" {
				t.Errorf("%s: Type=%s: want exec (the processes do not notify)", where, v)
			}
			if v := unitValue(t, where, opts, "Service", "Restart"); v != "on-failure" && v != "always" {
				t.Errorf("%s: Restart=%s", where, v)
			}
			if v := unitValue(t, where, opts, "Service", "KillSignal"); v != tc.killSignal {
				t.Errorf("%s: KillSignal=%s: want %s", where, v, tc.killSignal)
			}
			stop, err := time.ParseDuration(unitValue(t, where, opts, "Service", "TimeoutStopSec"))
			if err != nil || stop < tc.stopBound {
				t.Errorf("%s: TimeoutStopSec %v (%v): the process may take %v to stop cleanly", where, stop, err, tc.stopBound)
			}
			for k, want := range hardening {
				if got := unitValues(opts, "Service", k); len(got) != 1 || got[0] != want {
					t.Errorf("%s: %s=%v: want %q", where, k, got, want)
				}
			}
			if u := unitValues(opts, "Service", "User"); len(u) != 1 || u[0] == "root" {
				t.Errorf("%s: User=%v: want a user of its own", where, u)
			}
			files := unitValues(opts, "Service", "EnvironmentFile")
			if len(files) == 0 {
				t.Errorf("%s: no EnvironmentFile", where)
			}
			for _, f := range files {
				base := path.Base(expandSpecifiers(t, where, tc.unit, tc.instance, strings.TrimPrefix(f, "-")))
				if _, err := os.Stat(filepath.Join("systemd", base)); err != nil {
					t.Errorf("%s: EnvironmentFile %s: want an example deploy/systemd/%s", where, f, base)
				}
			}
			if tc.unit == "nats-server.service" {
				return // its ExecStart is checked by TestNATSServerUnitConfig
			}
			// The command line, with the environment the unit gives it.
			for _, f := range files {
				base := path.Base(expandSpecifiers(t, where, tc.unit, tc.instance, f))
				for k, v := range readEnvFile(t, filepath.Join("systemd", base)) {
					t.Setenv(k, v)
				}
			}
			argv := execStart(t, tc.unit, tc.instance)
			cl := parseCommandLine(t, where, argv)
			creds := map[string]bool{}
			for _, lc := range unitValues(opts, "Service", "LoadCredential") {
				id, _, _ := strings.Cut(lc, ":")
				creds[id] = true
			}
			credDir := expandSpecifiers(t, where, tc.unit, tc.instance, "%d") + "/"
			for _, name := range fileFlags {
				p := cl.value(name)
				if !cl.given(name) || !strings.HasPrefix(p, credDir) {
					continue
				}
				if id := strings.TrimPrefix(p, credDir); !creds[id] {
					t.Errorf("%s: --%s %s: no LoadCredential=%s:...", where, name, p, id)
				}
			}
			switch cl.binary {
			case "engine":
				if cl.cmd.Name() != "serve" || cl.value("workers") != "0" {
					t.Errorf("%s: want engine serve --workers 0", where)
				}
			case "worker":
				if cl.value("pool") != tc.instance {
					t.Errorf("%s: --pool %q: want the instance (%%i)", where, cl.value("pool"))
				}
				// The worker reads workflow secrets from the credentials
				// directory by default: its NATS seed must not be there,
				// or a workflow could read it as {{secret "worker.nk"}}.
				if strings.HasPrefix(cl.value("nkey"), credDir) || strings.HasPrefix(cl.value("creds"), credDir) {
					t.Errorf("%s: the NATS credentials are in the credentials directory, which workflows read as secrets", where)
				}
				if _, err := listenAddr(cl.value("metrics")); err != nil {
					t.Errorf("%s: metrics address (WAYMARK_WORKER_METRICS) %q: %v", where, cl.value("metrics"), err)
				}
			}
		})
	}
}
