package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/schemas"
)

type syncBuf = testsupport.SyncBuffer

// canaryForms returns the spellings of v a store could hold it in: plain,
// hex, and the part of its base64 encoding (standard and URL alphabets)
// that v alone decides, at each of the three alignments.
func canaryForms(v string) map[string]string {
	h := hex.EncodeToString([]byte(v))
	forms := map[string]string{"plain": v, "hex": h, "HEX": strings.ToUpper(h)}
	for _, enc := range []struct {
		name string
		e    *base64.Encoding
	}{{"base64", base64.StdEncoding}, {"base64url", base64.URLEncoding}} {
		for lead := 0; lead < 3; lead++ {
			body := []byte(v)[(3-lead)%3:]
			forms[fmt.Sprintf("%s@%d", enc.name, lead)] = enc.e.EncodeToString(body[:len(body)/3*3])
		}
	}
	return forms
}

// canarySearch records every place a form of the canary turns up.
type canarySearch struct {
	forms map[string]string
	mu    sync.Mutex
	hits  []string
	seen  int // bytes searched
}

func (c *canarySearch) search(where string, data []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seen += len(data)
	for name, f := range c.forms {
		if i := bytes.Index(data, []byte(f)); i >= 0 {
			lo, hi := max(0, i-60), min(len(data), i+len(f)+60)
			c.hits = append(c.hits, fmt.Sprintf("%s: %s form at byte %d: …%q…", where, name, i, data[lo:hi]))
		}
	}
}

// TestCanarySecretIsStoredNowhere plants a canary secret, runs an http
// step and a model step whose providers echo the credential in 2xx bodies
// and in error bodies (retried, then failing the job), and searches every
// stored byte for it: each KV bucket and stream read through JetStream,
// the raw files of the data directory, the engine's and worker's log, and
// what status, history, list, effects list and the HTTP API print. The
// providers must have seen it, and the job's state must show it redacted.
func TestCanarySecretIsStoredNowhere(t *testing.T) {
	t.Parallel()
	rnd := make([]byte, 12)
	_, _ = rand.Read(rnd)
	canary := "wmcanary" + hex.EncodeToString(rnd)

	secretsDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(secretsDir, "canary_token"), []byte(canary+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var seenByProviders atomic.Int64
	sawCanary := func(s string) {
		if strings.Contains(s, canary) {
			seenByProviders.Add(1)
		}
	}
	// The echo service answers /ok with everything the request carried, in
	// several encodings, and /fail first with a 500, then a 401, echoing it.
	var fails atomic.Int64
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth := r.Header.Get("Authorization")
		sawCanary(auth)
		body, _ := io.ReadAll(r.Body)
		all := map[string]string{"auth": auth, "b64": base64.StdEncoding.EncodeToString([]byte(auth)),
			"b64url": base64.URLEncoding.EncodeToString([]byte("?" + auth)), "hex": hex.EncodeToString([]byte(auth)), "body": string(body)}
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/ok":
			_ = json.NewEncoder(w).Encode(all)
		case "/fail":
			if fails.Add(1) == 1 {
				w.WriteHeader(http.StatusInternalServerError)
				_ = json.NewEncoder(w).Encode(all)
				return
			}
			w.WriteHeader(http.StatusUnauthorized)
			fmt.Fprintf(w, "invalid credentials: Authorization: %s (hex %s)", auth, all["hex"])
		}
	}))
	t.Cleanup(echo.Close)
	model := func(start func(testing.TB, fakemodel.Handler) *fakemodel.Server) *fakemodel.Server {
		return start(t, func(_ context.Context, req fakemodel.Request) fakemodel.Response {
			key := req.APIKey()
			sawCanary(key)
			if strings.Contains(req.Prompt, "fail") {
				return fakemodel.Response{Status: http.StatusUnauthorized, Text: "invalid api key " + key + " / " + base64.StdEncoding.EncodeToString([]byte(key))}
			}
			return fakemodel.Response{Text: fmt.Sprintf(`{"label": "ok", "echo": %q, "hex": %q}`, key, hex.EncodeToString([]byte(key)))}
		})
	}
	anthropic, openai := model(fakemodel.NewAnthropic), model(fakemodel.NewOpenAI)

	workflow := fmt.Sprintf(`
name: canary
version: 1
defaults:
  timeout: 20s
  retry: {max_attempts: 2, backoff: {initial: 10ms, max: 20ms}}
steps:
  - id: echo_ok
    kind: http
    with:
      url: '{{service "echo"}}/ok'
      headers: {Authorization: 'Bearer {{secret "canary_token"}}'}
      body: {note: '{{.state.note}}'}
    save_as: echoed
    next: [{to: model_ok}]
  - id: model_ok
    kind: model
    with: {provider: anthropic, model: fake, base_url: %q, api_key_secret: canary_token, prompt: 'say ok'}
    save_as: model
    next: [{to: echo_fail}]
  - id: echo_fail
    kind: http
    with:
      url: '{{service "echo"}}/fail'
      headers: {Authorization: 'Bearer {{secret "canary_token"}}'}
      body: {}
    on_error: model_fail
  - id: model_fail
    kind: model
    with: {provider: openai, model: fake, base_url: %q, api_key_secret: canary_token, prompt: 'please fail'}
`, anthropic.URL(), openai.URL())

	dataDir := t.TempDir()
	var serveOut, serveLog syncBuf
	cmd := NewEngineCommand(&serveOut, &serveLog)
	cmd.SetArgs([]string{"serve", "--data-dir", dataDir, "--sync", "interval", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
		"--service", "echo=" + echo.URL, "--secrets-dir", secretsDir, "--log-level", "debug", "--log-format", "json"})
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- cmd.ExecuteContext(ctx) }()
	stopped := false
	stopServe := func() {
		if stopped {
			return
		}
		stopped = true
		stop()
		select {
		case err := <-served:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("serve did not stop within 30s")
		}
	}
	t.Cleanup(stopServe)
	var natsURL, httpURL string
	addrs := regexp.MustCompile(`(?m)^nats: (nats://\S+).*\n(?:.*\n)*?http: (http://\S+)`)
	testsupport.Eventually(t, 30*time.Second, func() bool {
		m := addrs.FindStringSubmatch(serveOut.String())
		if m != nil {
			natsURL, httpURL = m[1], m[2]
		}
		return m != nil
	}, "serve did not print its addresses: %s %s", &serveOut, &serveLog)

	cli := func(args ...string) string {
		t.Helper()
		out, errOut, code := execute(t, append(args, "--nats-url", natsURL)...)
		if code != 0 {
			t.Fatalf("engine %v: exit %d\n%s\n%s", args, code, out, errOut)
		}
		return out + errOut
	}
	// Started over the HTTP API: engine start checks model steps in replay
	// mode and refuses one without a cassette (issue 8, Inputs).
	post := func(path, body string) []byte {
		t.Helper()
		resp, err := http.Post(httpURL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("POST %s: %v", path, err)
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		if resp.StatusCode/100 != 2 {
			t.Fatalf("POST %s: %d %s", path, resp.StatusCode, out)
		}
		return out
	}
	post("/v1/workflows", workflow)
	var started struct {
		JobID string `json:"job_id"`
	}
	if err := json.Unmarshal(post("/v1/jobs", `{"workflow": "canary", "input": {"note": "hello"}}`), &started); err != nil || started.JobID == "" {
		t.Fatalf("start: %v %+v", err, started)
	}
	job := started.JobID
	var view struct {
		Status schemas.JobStatus `json:"status"`
		State  struct {
			Echoed map[string]string `json:"echoed"`
			Model  map[string]string `json:"model"`
		} `json:"state"`
	}
	testsupport.Eventually(t, 60*time.Second, func() bool {
		_ = json.Unmarshal([]byte(cli("status", job, "-o", "json")), &view)
		return view.Status.Stopped()
	}, "job %s did not stop; log:\n%s", job, &serveLog)
	if view.Status != schemas.JobFailed {
		t.Fatalf("job %s is %s, want failed (its last step's provider refuses the key)", job, view.Status)
	}
	if seenByProviders.Load() < 4 {
		t.Fatalf("the providers saw the canary %d times, want every call to carry it", seenByProviders.Load())
	}
	// Scrubbed, not missing: the echoes are in state, redacted by name.
	if view.State.Echoed["auth"] != "Bearer [redacted:canary_token]" || view.State.Model["echo"] != "[redacted:canary_token]" {
		t.Errorf("state = %+v; want the echoes redacted by name", view.State)
	}

	s := &canarySearch{forms: canaryForms(canary)}
	for _, args := range [][]string{
		{"status", job}, {"status", job, "-o", "json"}, {"history", job}, {"history", job, "-o", "json"},
		{"list"}, {"list", "-o", "json"}, {"effects", "list"}, {"effects", "list", "-o", "json"}, {"effects", "list", "--job", job, "-o", "json"},
	} {
		s.search("engine "+strings.Join(args, " "), []byte(cli(args...)))
	}
	for _, path := range []string{"/v1/jobs/" + job, "/v1/jobs/" + job + "/history", "/v1/jobs", "/v1/effects?job=" + job, "/v1/effects", "/metrics"} {
		resp, err := http.Get(httpURL + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, resp.StatusCode, body)
		}
		s.search("GET "+path, body)
	}
	if !strings.Contains(cli("history", job), "[redacted:canary_token]") {
		t.Error("history does not show the redacted provider errors; the failures were not recorded as the test expects")
	}
	searchJetStream(t, natsURL, s)
	stopServe()
	s.search("engine and worker log", []byte(serveLog.String()))
	s.search("serve output", []byte(serveOut.String()))
	files := 0
	err := filepath.WalkDir(dataDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		files++
		s.search(path, data)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files == 0 || !strings.Contains(serveLog.String(), "step attempt failed") {
		t.Fatalf("searched %d data files and a log without failed attempts: the search saw nothing", files)
	}
	for _, h := range s.hits {
		t.Error(h)
	}
	t.Logf("searched %d bytes (%d data files) for %d forms of the canary", s.seen, files, len(s.forms))
}

// searchJetStream reads every message of every stream (KV buckets and
// object stores included), headers and data, through JetStream.
func searchJetStream(t *testing.T, url string, s *canarySearch) {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	streams, msgs := 0, 0
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		st, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		info, err := st.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		streams++
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue // deleted, or acknowledged off a work queue
			}
			if err != nil {
				t.Fatalf("stream %s seq %d: %v", name, seq, err)
			}
			msgs++
			where := fmt.Sprintf("stream %s seq %d (%s)", name, seq, m.Subject)
			s.search(where, m.Data)
			for k, vs := range m.Header {
				s.search(where+" header "+k, []byte(strings.Join(vs, "\n")))
			}
		}
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	if streams < 5 || msgs == 0 {
		t.Fatalf("read %d messages of %d streams: the layout was not found", msgs, streams)
	}
}

func TestSecretFlagErrors(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "not-a-dir")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--secrets-dir", missing}, `--secrets-dir "` + missing + `": no such file or directory`},
		{[]string{"serve", "--secrets-dir", file}, `--secrets-dir "` + file + `": not a directory`},
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--secret-env", "NOT-A-VAR"}, `--secret-env "NOT-A-VAR": want an environment variable name`},
		{[]string{"worker", "--secrets-dir", missing}, `--secrets-dir "` + missing + `"`},
		{[]string{"worker", "--secret-env", "1ABC"}, `--secret-env "1ABC"`},
	} {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			t.Parallel()
			args := append(tt.args, "--data-dir", t.TempDir())
			var code int
			var errOut string
			if args[0] == "worker" {
				var out, eb bytes.Buffer
				cmd := NewWorkerCommand(&out, &eb, nil)
				cmd.SetArgs(append(args[1:len(args)-2], "--nats-url", unreachable))
				err := cmd.ExecuteContext(context.Background())
				var ee *ExitError
				if errors.As(err, &ee) {
					code = ee.Code
				}
				if err != nil {
					errOut = err.Error()
				}
			} else {
				_, errOut, code = execute(t, args...)
			}
			if code != 2 || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d stderr %q, want 2 and %q", code, errOut, tt.want)
			}
		})
	}
}

// TestSecretsDirDefaultsToSystemdCredentials: a worker started by systemd
// with LoadCredential= finds its secrets in $CREDENTIALS_DIRECTORY, and a
// bad one is reported as coming from there. Not parallel: it sets the
// process environment.
func TestSecretsDirDefaultsToSystemdCredentials(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "creds")
	t.Setenv("WAYMARK_SECRETS_DIR", "")
	t.Setenv("CREDENTIALS_DIRECTORY", missing)
	_, errOut, code := execute(t, "run", repo("examples/quickstart/workflow.yaml"), "--data-dir", t.TempDir())
	if code != 2 || !strings.Contains(errOut, `--secrets-dir "`+missing+`" (from CREDENTIALS_DIRECTORY)`) {
		t.Errorf("exit %d stderr %q; want the directory named as systemd's", code, errOut)
	}
}

// TestRunReadsSecretsFromTheEnvironment: engine run's worker sends
// WAYMARK_SECRET_* variables and those --secret-env (or WAYMARK_SECRETS_ENV)
// exposes, and nothing else. Not parallel: it sets the process environment.
func TestRunReadsSecretsFromTheEnvironment(t *testing.T) {
	t.Setenv("WAYMARK_SECRET_WM_PREFIXED", "prefixed-value-123")
	t.Setenv("WM_EXPOSED_TOKEN", "exposed-value-456")
	t.Setenv("WM_OTHER_TOKEN", "other-value-789")
	t.Setenv("WAYMARK_SECRETS_ENV", "WM_OTHER_TOKEN")
	var mu sync.Mutex
	got := map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got[r.URL.Path] = r.Header.Get("Authorization")
		mu.Unlock()
		_, _ = io.WriteString(w, `{"ok": true}`)
	}))
	t.Cleanup(srv.Close)
	wf := writeWorkflow(t, `
name: env-secrets
version: 1
steps:
  - id: a
    kind: http
    with: {url: '{{service "svc"}}/a', headers: {Authorization: '{{secret "WM_PREFIXED"}}'}}
    next: [{to: b}]
  - id: b
    kind: http
    with: {url: '{{service "svc"}}/b', headers: {Authorization: '{{secret "WM_EXPOSED_TOKEN"}}'}}
    next: [{to: c}]
  - id: c
    kind: http
    with: {url: '{{service "svc"}}/c', headers: {Authorization: '{{secret "WM_OTHER_TOKEN"}}'}}
    next: [{to: d}]
  - id: d
    kind: http
    with: {url: '{{service "svc"}}/d', headers: {Authorization: '{{secret "HOME"}}'}}
`)
	out, errOut, code := execute(t, "run", wf, "--data-dir", t.TempDir(), "--sync", "interval", "--service", "svc="+srv.URL,
		"--secret-env", "WM_EXPOSED_TOKEN", "--secret-env", "WM_OTHER_TOKEN")
	mu.Lock()
	defer mu.Unlock()
	want := map[string]string{"/a": "prefixed-value-123", "/b": "exposed-value-456", "/c": "other-value-789"}
	for path, v := range want {
		if got[path] != v {
			t.Errorf("%s got Authorization %q, want %q", path, got[path], v)
		}
	}
	if _, called := got["/d"]; called {
		t.Error("a step reading HOME, which no flag exposes, made its call")
	}
	if code != 1 || !strings.Contains(errOut, `secret \"HOME\" is not set on this worker`) && !strings.Contains(errOut+out, `secret "HOME" is not set on this worker`) {
		t.Errorf("exit %d\n%s\n%s; want 1 and the unknown secret named", code, out, errOut)
	}
}
