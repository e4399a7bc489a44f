package steps

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/schemas"
)

// Secret values of the http tests, each with characters an encoder
// escapes where the place allows them.
var httpSecrets = map[string]string{
	"API_TOKEN":  `tok/Abc+def=ghi"jkl<0123>&x`,
	"PATH_TOKEN": "pathtok-9f8e7d6c5b4a",
	"QUERY_KEY":  "qk_live_Zm9vYmFyYmF6",
	"CARD":       "4242-4242-4242-4242/cvc:123",
}

// literalCredential is a credential header written in the definition: no
// secret, but scrubbed from errors all the same.
const literalCredential = "literal-credential-value"

const secretHTTPWorkflow = `
name: secret-http
version: 1
steps:
  - id: call
    kind: http
    with:
      url: '{{service "tickets"}}/v1/{{secret "PATH_TOKEN"}}/charge?key={{secret "QUERY_KEY"}}'
      headers:
        Authorization: 'Bearer {{secret "API_TOKEN"}}'
        X-Api-Key: ` + literalCredential + `
        X-Trace: '{{.job}}'
      body:
        card: '{{secret "CARD"}}'
        amount: '{{json .state.amount}}'
  - id: missing
    kind: http
    effect: unsafe
    with:
      url: '{{service "tickets"}}/v1/charge'
      headers: {Authorization: 'Bearer {{secret "NOT_THERE"}}'}
      body: {amount: 1}
  - id: look
    kind: http
    effect: lookup
    with:
      url: '{{service "tickets"}}/v1/records'
      headers: {Authorization: 'Bearer {{secret "API_TOKEN"}}'}
      body: {}
      lookup: {url: '{{service "tickets"}}/v1/records/{{urlquery .idempotency_key}}'}
`

// echo is what the echoing test server sends back: everything the request
// carried, in several encodings.
func echo(r *http.Request, body []byte) map[string]any {
	auth := r.Header.Get("Authorization")
	return map[string]any{
		"error":       "bad credentials",
		"auth":        auth,
		"auth_b64":    base64.StdEncoding.EncodeToString([]byte(auth)),
		"auth_b64url": base64.URLEncoding.EncodeToString([]byte("x" + auth)),
		"auth_hex":    hex.EncodeToString([]byte(auth)),
		"api_key":     r.Header.Get("X-Api-Key"),
		"path":        r.URL.Path,
		"query":       r.URL.RawQuery,
		"body":        string(body),
	}
}

// setupSecretHTTP is an echoing service (respond picks the status and
// the form of the echo) and an Env holding httpSecrets in a directory.
func setupSecretHTTP(t *testing.T, respond func(w http.ResponseWriter, r *http.Request, body []byte)) (*httpBundle, *schemas.Definition) {
	t.Helper()
	var mu sync.Mutex
	var bundle *httpBundle
	b := setupHTTP(t, func(n int, w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hb := bundle
		mu.Unlock()
		respond(w, r, hb.requests()[n-1].Body)
	})
	mu.Lock()
	bundle = b
	mu.Unlock()
	env := secretsEnv(t, httpSecrets, nil)
	b.env.Secrets, b.env.Getenv = env.Secrets, env.Getenv
	return b, parseDef(t, secretHTTPWorkflow)
}

// assertNoSecret fails when text holds any form of any test secret or the
// literal credential.
func assertNoSecret(t *testing.T, what, text string) {
	t.Helper()
	for name, v := range httpSecrets {
		if l := leaks(text, v); len(l) > 0 {
			t.Errorf("%s holds secret %s as %v: %s", what, name, l, text)
		}
	}
	if strings.Contains(text, literalCredential) && !strings.HasPrefix(what, "output") {
		t.Errorf("%s holds the literal credential: %s", what, text)
	}
}

func TestHTTPSecretsReachTheServerOnly(t *testing.T) {
	t.Parallel()
	b, def := setupSecretHTTP(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(echo(r, body))
	})
	out, err := mustPrepare(t, def, "call", b.env).Run(t.Context(), newCall(def, "call", `{"amount": 4999}`))
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	r := b.requests()[0]
	if r.Path != "/v1/"+httpSecrets["PATH_TOKEN"]+"/charge" || r.RawQuery != "key="+httpSecrets["QUERY_KEY"] {
		t.Errorf("server got %s?%s, want the secrets in the path and query", r.Path, r.RawQuery)
	}
	if got := r.Header.Get("Authorization"); got != "Bearer "+httpSecrets["API_TOKEN"] {
		t.Errorf("Authorization = %q, want the secret", got)
	}
	var sent map[string]any
	if err := json.Unmarshal(r.Body, &sent); err != nil || sent["card"] != httpSecrets["CARD"] || sent["amount"] != 4999.0 {
		t.Errorf("body = %s (%v), want the card secret and the amount", r.Body, err)
	}
	raw, _ := encodeOutput(out)
	if !json.Valid(raw) {
		t.Fatalf("output %s is not JSON", raw)
	}
	assertNoSecret(t, "output", string(raw))
	var got map[string]string
	_ = json.Unmarshal(raw, &got)
	if got["auth"] != "Bearer [redacted:API_TOKEN]" || got["error"] != "bad credentials" || got["api_key"] != literalCredential {
		t.Errorf("output = %s; want secrets redacted by name and the rest kept", raw)
	}
}

func TestHTTPSecretsScrubbedFromErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		status int
		reply  func(w http.ResponseWriter, r *http.Request, body []byte)
	}{
		{name: "401 echoing JSON", status: 401, reply: func(w http.ResponseWriter, r *http.Request, body []byte) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(401)
			_ = json.NewEncoder(w).Encode(echo(r, body))
		}},
		{name: "500 echoing JSON with every escape", status: 500, reply: func(w http.ResponseWriter, r *http.Request, body []byte) {
			w.WriteHeader(500)
			fmt.Fprintf(w, `{"auth": "%s", "slashes": "%s"}`, unicodeEscaped(r.Header.Get("Authorization")),
				strings.ReplaceAll(strings.ReplaceAll(r.Header.Get("Authorization"), `"`, `\"`), "/", `\/`))
		}},
		{name: "403 echoing plain text", status: 403, reply: func(w http.ResponseWriter, r *http.Request, body []byte) {
			w.WriteHeader(403)
			fmt.Fprintf(w, "denied: Authorization=%s X-Api-Key=%s path=%s query=%s body=%s", r.Header.Get("Authorization"),
				r.Header.Get("X-Api-Key"), r.URL.Path, r.URL.RawQuery, body)
		}},
		{name: "a secret across the excerpt's end", status: 400, reply: func(w http.ResponseWriter, r *http.Request, _ []byte) {
			w.WriteHeader(400)
			// The token starts a few bytes before the 300-byte cut.
			fmt.Fprintf(w, "%s%s", strings.Repeat("x", 290-len("Bearer ")), r.Header.Get("Authorization"))
		}},
		{name: "200 text echoing the token", status: 200, reply: func(w http.ResponseWriter, r *http.Request, _ []byte) {
			fmt.Fprintf(w, "<html>%s</html>", r.Header.Get("Authorization"))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b, def := setupSecretHTTP(t, tt.reply)
			out, err := mustPrepare(t, def, "call", b.env).Run(t.Context(), newCall(def, "call", `{"amount": 1}`))
			if tt.status == 200 {
				// A text response is the output ({content_type, text, bytes}),
				// scrubbed like any output.
				raw, _ := json.Marshal(out)
				if err != nil || !strings.Contains(string(raw), `"text"`) {
					t.Fatalf("Run: %s, %v; want the text as the output", raw, err)
				}
				assertNoSecret(t, "output", string(raw))
				return
			}
			if err == nil {
				t.Fatal("Run succeeded, want the provider's error")
			}
			e := toError(err)
			assertNoSecret(t, "error", e.Message)
			assertNoSecret(t, "error", err.Error())
			if strings.Contains(e.Message, httpSecrets["API_TOKEN"][:8]) {
				t.Errorf("error %q holds the start of the token", e.Message)
			}
			if tt.status != 200 && !strings.Contains(e.Message, fmt.Sprintf("status %d", tt.status)) {
				t.Errorf("error %q lost the status", e.Message)
			}
		})
	}
}

func TestHTTPUnknownSecretIsNotSent(t *testing.T) {
	t.Parallel()
	b, def := setupSecretHTTP(t, func(w http.ResponseWriter, _ *http.Request, _ []byte) { w.WriteHeader(201) })
	_, err := mustPrepare(t, def, "missing", b.env).Run(t.Context(), newCall(def, "missing", `{}`))
	wantStepError(t, err, schemas.CodeStepFailed, false, `secret "NOT_THERE" is not set on this worker`, "WAYMARK_SECRET_NOT_THERE")
	if !notPerformed(err) {
		t.Error("an unknown secret is not marked not performed: an unsafe step would be declared ambiguous")
	}
	if n := len(b.requests()); n != 0 {
		t.Errorf("server got %d requests, want none", n)
	}
}

func TestHTTPLookupSendsHeadersAndIsScrubbed(t *testing.T) {
	t.Parallel()
	b, def := setupSecretHTTP(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(echo(r, body))
	})
	l := mustPrepare(t, def, "look", b.env).(Looker)
	found, out, err := l.Lookup(t.Context(), newCall(def, "look", `{}`))
	if err != nil || !found {
		t.Fatalf("Lookup = %v, %v", found, err)
	}
	if got := b.requests()[0].Header.Get("Authorization"); got != "Bearer "+httpSecrets["API_TOKEN"] {
		t.Errorf("lookup Authorization = %q, want the step's header", got)
	}
	raw, _ := encodeOutput(out)
	assertNoSecret(t, "output of the lookup", string(raw))
}

func TestSecretRefusedOutsideRequests(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, yaml, path, want string
	}{
		{name: "idempotency key", path: "steps[0].idempotency_key", want: "template s.idempotency_key: {{secret}} is not allowed here", yaml: `
steps:
  - id: s
    kind: http
    idempotency_key: '{{.state.order}}-{{secret "K1234"}}'
    with: {url: 'http://x', body: {}}`},
		{name: "prompt", path: "steps[0].with", want: "template s.prompt: {{secret}} is not allowed here", yaml: `
steps:
  - id: s
    kind: model
    with: {provider: replay, prompt: 'key {{secret "K1234"}}'}`},
		{name: "system prompt", path: "steps[0].with", want: "template s.system: {{secret}} is not allowed here", yaml: `
steps:
  - id: s
    kind: model
    with: {provider: replay, prompt: hi, system: '{{if true}}{{secret "K1234"}}{{end}}'}`},
		{name: "a computed name in a header", path: "steps[0].with", want: "the name given to secret must be written out", yaml: `
steps:
  - id: s
    kind: http
    with: {url: 'http://x', headers: {Authorization: 'Bearer {{secret .state.which}}'}}`},
		{name: "a custom kind's key", path: "steps[0].idempotency_key", want: "not allowed here", yaml: `
steps:
  - id: s
    kind: enrich
    idempotency_key: '{{secret "K1234"}}'`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := schemas.Parse("w.yaml", []byte("name: w\nversion: 1\n"+tt.yaml), schemas.LoadOptions{Checks: []schemas.CheckFunc{Builtins().Check(nil, "enrich")}})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Parse = %v, want an error containing %q", err, tt.want)
			}
			if !errors.Is(err, schemas.ErrDefinitionInvalid) {
				t.Errorf("Parse error %v does not match ErrDefinitionInvalid", err)
			}
			if !strings.Contains(err.Error(), "w.yaml:7:5: "+tt.path+": ") {
				t.Errorf("error %q does not name %s", err, tt.path)
			}
		})
	}
}

// modelSecretWorkflow is a live model step whose key is a secret.
func modelSecretWorkflow(provider, extra string) string {
	return fmt.Sprintf(`
name: model-secret
version: 1
steps:
  - id: classify
    kind: model
    with:
      provider: %s
      model: model-test
      prompt: "Classify {{.state.id}}"
%s`, provider, extra)
}

const modelSecretKey = "sk-ant-canary-Zq8/Lm+Pw=Xv"

func TestModelKeyFromSecret(t *testing.T) {
	t.Parallel()
	for _, w := range liveWires {
		t.Run(w.provider, func(t *testing.T) {
			t.Parallel()
			srv := w.start(t, func(_ context.Context, req fakemodel.Request) fakemodel.Response {
				switch {
				case strings.Contains(req.Prompt, "echo-error"):
					return fakemodel.Response{Status: 401, Text: "invalid x-api-key " + req.APIKey() + " (" + req.Header.Get("Authorization") + ")"}
				case strings.Contains(req.Prompt, "echo-text"):
					return fakemodel.Response{Text: "no JSON here, but your key is " + req.APIKey()}
				}
				return fakemodel.Response{Text: fmt.Sprintf(`{"label": "bug", "seen": %q}`, req.APIKey())}
			})
			env := secretsEnv(t, map[string]string{"model-key": modelSecretKey}, map[string]string{w.keyEnv: "the-default-key-must-not-be-used"})
			env.HTTPClient = srv.Client()
			record := filepath.Join(t.TempDir(), "rec.json")
			env.Getenv = func(k string) string {
				if k == RecordCassetteEnv {
					return record
				}
				return map[string]string{w.keyEnv: "the-default-key-must-not-be-used"}[k]
			}
			def := parseDef(t, modelSecretWorkflow(w.provider, "      base_url: "+srv.URL()+"\n      api_key_secret: model-key\n"))
			r := mustPrepare(t, def, "classify", env)

			out, err := r.Run(t.Context(), newCall(def, "classify", `{"id": "ok"}`))
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			if got := srv.Requests()[0].APIKey(); got != modelSecretKey {
				t.Errorf("server saw key %q, want the secret", got)
			}
			raw, _ := encodeOutput(out)
			if string(raw) != `{"label":"bug","seen":"[redacted:model-key]"}` {
				t.Errorf("output = %s, want the echoed key redacted", raw)
			}

			_, err = r.Run(t.Context(), newCall(def, "classify", `{"id": "echo-error"}`))
			e := wantStepError(t, err, schemas.CodeProvider, false, "401", "invalid x-api-key [redacted")
			if l := leaks(e.Message, modelSecretKey); len(l) > 0 {
				t.Errorf("error %q holds the key as %v", e.Message, l)
			}

			_, err = r.Run(t.Context(), newCall(def, "classify", `{"id": "echo-text"}`))
			e = wantStepError(t, err, schemas.CodeReplyNotJSON, true, "[redacted:model-key]")
			if l := leaks(e.Message, modelSecretKey); len(l) > 0 {
				t.Errorf("error %q holds the key as %v", e.Message, l)
			}

			data, err := os.ReadFile(record)
			if err != nil {
				t.Fatalf("no cassette recorded: %v", err)
			}
			if l := leaks(string(data), modelSecretKey); len(l) > 0 || !strings.Contains(string(data), "[redacted:model-key]") {
				t.Errorf("cassette holds the key as %v, or no redaction: %s", l, data)
			}
		})
	}
}

func TestModelKeySources(t *testing.T) {
	t.Parallel()
	srv := fakemodel.NewOpenAI(t, fakemodel.Reply(`{"label": "x"}`))
	base := `"base_url": "` + srv.URL() + `"`
	tests := []struct {
		name    string
		with    string // settings besides provider, model and prompt
		vars    map[string]string
		exposed []string
		wantErr string // from Prepare, or from Run when runErr
		runErr  bool
		wantKey string // what the server saw
	}{
		{name: "a step's base_url does not get the provider's own key", with: base,
			vars: map[string]string{"OPENAI_API_KEY": "operator-key-1234"}, wantKey: "unused"},
		{name: "naming the own key with a base_url is refused", with: base + `, "api_key_env": "OPENAI_API_KEY"`,
			vars: map[string]string{"OPENAI_API_KEY": "operator-key-1234"}, wantErr: "the provider's own key is sent only to its public API"},
		{name: "the own key exposed by the worker may go to a base_url", with: base + `, "api_key_env": "OPENAI_API_KEY"`,
			vars: map[string]string{"OPENAI_API_KEY": "operator-key-1234"}, exposed: []string{"OPENAI_API_KEY"}, wantKey: "operator-key-1234"},
		{name: "a variable the worker does not expose is refused", with: base + `, "api_key_env": "AWS_SECRET_ACCESS_KEY"`,
			vars: map[string]string{"AWS_SECRET_ACCESS_KEY": "aws-secret-1234"}, wantErr: "this worker does not expose AWS_SECRET_ACCESS_KEY to workflows"},
		{name: "a WAYMARK_SECRET_ variable may be named", with: base + `, "api_key_env": "WAYMARK_SECRET_LLM"`,
			vars: map[string]string{"WAYMARK_SECRET_LLM": "llm-key-1234"}, wantKey: "llm-key-1234"},
		{name: "a secret from the environment", with: base + `, "api_key_secret": "LLM"`,
			vars: map[string]string{"WAYMARK_SECRET_LLM": "llm-key-5678"}, wantKey: "llm-key-5678"},
		{name: "a missing secret fails the call, naming it", with: base + `, "api_key_secret": "LLM"`,
			runErr: true, wantErr: `secret "LLM" is not set on this worker`},
		{name: "both sources", with: `"api_key_secret": "LLM", "api_key_env": "WAYMARK_SECRET_LLM"`, wantErr: "both name the key"},
		{name: "a bad secret name", with: `"api_key_secret": "../x"`, wantErr: "with.api_key_secret: secret name"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			env := secretsEnv(t, nil, tt.vars, tt.exposed...)
			env.HTTPClient = srv.Client()
			def := &schemas.Definition{Name: "k", Version: 1, Steps: []schemas.Step{{ID: "s", Kind: schemas.KindModel,
				With: json.RawMessage(`{"provider": "openai", "model": "model-test", "prompt": "Classify {{.state.id}}", ` + tt.with + `}`)}}}
			r, err := prepareStep(t, def, "s", env)
			if err == nil && tt.runErr {
				_, err = r.Run(t.Context(), newCall(def, "s", `{"id": "x"}`))
			}
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				for _, v := range tt.vars {
					if strings.Contains(err.Error(), v) {
						t.Errorf("error %q shows a value", err)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Prepare: %v", err)
			}
			if _, err := r.Run(t.Context(), newCall(def, "s", `{"id": "x"}`)); err != nil {
				t.Fatalf("Run: %v", err)
			}
			// The subtests share the server and run at once; each sends its
			// own key, so its request is the one with that key.
			n := 0
			for _, req := range srv.Requests() {
				if req.APIKey() == tt.wantKey {
					n++
				}
			}
			if n != 1 {
				t.Errorf("server saw key %q in %d requests, want 1", tt.wantKey, n)
			}
		})
	}
}
