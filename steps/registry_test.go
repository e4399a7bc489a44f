package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

func TestRegistryRegister(t *testing.T) {
	t.Parallel()
	ok := Func(func(context.Context, *Call) (any, error) { return nil, nil })
	tests := []struct {
		name    string
		kind    string
		k       Kind
		wantErr string
	}{
		{name: "simple", kind: "enrich", k: ok},
		{name: "dots dashes underscores", kind: "acme.crm-lookup_v2", k: ok},
		{name: "sixty-four characters", kind: "a" + strings.Repeat("b", 63), k: ok},
		{name: "empty", kind: "", k: ok, wantErr: "want lower-case letters"},
		{name: "upper case", kind: "Enrich", k: ok, wantErr: "want lower-case letters"},
		{name: "leading digit", kind: "1enrich", k: ok, wantErr: "want lower-case letters"},
		{name: "space", kind: "en rich", k: ok, wantErr: "want lower-case letters"},
		{name: "sixty-five characters", kind: "a" + strings.Repeat("b", 64), k: ok, wantErr: "want lower-case letters"},
		{name: "nil kind", kind: "enrich", k: nil, wantErr: "nil Kind"},
		{name: "duplicate of a builtin", kind: schemas.KindHTTP, k: ok, wantErr: "already registered"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := Builtins()
			err := r.Register(tt.kind, tt.k)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Register(%q) = %v, want an error containing %q", tt.kind, err, tt.wantErr)
				}
				if tt.kind != schemas.KindHTTP {
					if _, found := r.Lookup(tt.kind); found {
						t.Errorf("rejected kind %q was registered", tt.kind)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Register(%q): %v", tt.kind, err)
			}
			if _, found := r.Lookup(tt.kind); !found {
				t.Errorf("Lookup(%q) after Register: not found", tt.kind)
			}
		})
	}
}

func TestRegistryNames(t *testing.T) {
	t.Parallel()
	r := Builtins()
	if got, want := strings.Join(r.Names(), ","), "agent,http,mcp,model,noop,store"; got != want {
		t.Errorf("Builtins().Names() = %s, want %s", got, want)
	}
	if err := r.Register("enrich", Func(func(context.Context, *Call) (any, error) { return nil, nil })); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(r.Names(), ","), "agent,enrich,http,mcp,model,noop,store"; got != want {
		t.Errorf("Names() = %s, want %s", got, want)
	}
	if got := NewRegistry().Names(); len(got) != 0 {
		t.Errorf("NewRegistry().Names() = %v, want none", got)
	}
}

const checkWorkflow = `
name: check
version: 1
steps:
  - id: first
    kind: noop
  - id: enrich
    kind: enrich
  - id: remote
    kind: acme.remote
  - id: call
    kind: http
    with:
      url: http://example.test/x
      headers: {Idempotency-Key: mine}
  - id: ask
    kind: model
    with: {provider: replay, prompt: hi}
`

func TestRegistryCheck(t *testing.T) {
	t.Parallel()
	def := parseDef(t, checkWorkflow)
	got := Builtins().Check(&Env{}, "acme.remote")(def)
	want := []struct{ path, contains string }{
		{"/steps/1/kind", `unknown step kind "enrich" (known: agent, http, mcp, model, noop, store); if workers of your own binary register it, allow it with --allow-kind enrich`},
		{"/steps/3/with", "Idempotency-Key is set by Waymark"},
		{"/steps/4/with", "needs a cassette"},
	}
	if len(got) != len(want) {
		t.Fatalf("Check found %d problems, want %d: %+v", len(got), len(want), got)
	}
	for i, w := range want {
		if got[i].Path != w.path || !strings.Contains(got[i].Message, w.contains) {
			t.Errorf("problem %d = %+v, want path %s and a message containing %q", i, got[i], w.path, w.contains)
		}
	}

	// Without the allowance the remote kind is unknown too.
	if ps := Builtins().Check(&Env{})(def); len(ps) != 4 || ps[1].Path != "/steps/2/kind" {
		t.Errorf("Check without allowed kinds = %+v, want the remote kind reported at /steps/2/kind", ps)
	}
}

func TestRegistryCheckThroughLoader(t *testing.T) {
	t.Parallel()
	_, err := schemas.Parse("check.yaml", []byte(checkWorkflow), schemas.LoadOptions{
		Checks: []schemas.CheckFunc{Builtins().Check(nil, "acme.remote")},
	})
	if !errors.Is(err, schemas.ErrDefinitionInvalid) {
		t.Fatalf("Parse = %v, want ErrDefinitionInvalid", err)
	}
	var de *schemas.DefinitionError
	if !errors.As(err, &de) || len(de.Problems) != 3 {
		t.Fatalf("Parse = %v, want a DefinitionError with 3 problems", err)
	}
	if de.Problems[0].Line == 0 {
		t.Errorf("problem %+v has no line: the loader should locate a check's paths", de.Problems[0])
	}
}

func TestToError(t *testing.T) {
	t.Parallel()
	provider := &schemas.Error{Code: schemas.CodeProvider, Message: "upstream 503", Retryable: false}
	tests := []struct {
		name          string
		err           error
		wantCode      schemas.Code
		wantRetryable bool
		wantMessage   string
	}{
		{name: "plain error", err: errors.New("boom"), wantCode: schemas.CodeStepFailed, wantRetryable: true, wantMessage: "boom"},
		{name: "non-retryable plain", err: NonRetryable(errors.New("bad input")), wantCode: schemas.CodeStepFailed, wantMessage: "bad input"},
		{name: "non-retryable wrapped further", err: fmt.Errorf("enrich: %w", NonRetryable(errors.New("bad input"))), wantCode: schemas.CodeStepFailed, wantMessage: "bad input"},
		{name: "non-retryable typed keeps code", err: NonRetryable(schemas.Errorf(schemas.CodeTooLarge, "%d bytes", 5)), wantCode: schemas.CodeTooLarge, wantMessage: "5 bytes"},
		{name: "retryable overrides typed", err: Retryable(provider), wantCode: schemas.CodeProvider, wantRetryable: true, wantMessage: "upstream 503"},
		{name: "typed retryable kept", err: &schemas.Error{Code: schemas.CodeProvider, Message: "429", Retryable: true}, wantCode: schemas.CodeProvider, wantRetryable: true, wantMessage: "429"},
		{name: "typed non-retryable kept", err: fmt.Errorf("call: %w", provider), wantCode: schemas.CodeProvider, wantMessage: "upstream 503"},
		{name: "context deadline", err: context.DeadlineExceeded, wantCode: schemas.CodeTimeout, wantRetryable: true, wantMessage: "context deadline exceeded"},
		{name: "wrapped context deadline", err: fmt.Errorf("fetch: %w", context.DeadlineExceeded), wantCode: schemas.CodeTimeout, wantRetryable: true, wantMessage: "fetch: context deadline exceeded"},
		{name: "context canceled", err: context.Canceled, wantCode: schemas.CodeStepFailed, wantRetryable: true, wantMessage: "context canceled"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := toError(tt.err)
			if got.Code != tt.wantCode || got.Retryable != tt.wantRetryable || got.Message != tt.wantMessage {
				t.Errorf("toError(%v) = {%s %q retryable=%v}, want {%s %q retryable=%v}",
					tt.err, got.Code, got.Message, got.Retryable, tt.wantCode, tt.wantMessage, tt.wantRetryable)
			}
			if !errors.Is(got, &schemas.Error{Code: tt.wantCode}) {
				t.Errorf("errors.Is(toError(...), sentinel %s) = false", tt.wantCode)
			}
			// The result survives the trip through the inbox.
			raw, err := json.Marshal(got)
			if err != nil {
				t.Fatal(err)
			}
			var back schemas.Error
			if err := json.Unmarshal(raw, &back); err != nil {
				t.Fatal(err)
			}
			if back.Code != got.Code || back.Retryable != got.Retryable || back.Message != got.Message {
				t.Errorf("round trip = %+v, want %+v", back, *got)
			}
		})
	}

	t.Run("copies, never aliases", func(t *testing.T) {
		t.Parallel()
		orig := &schemas.Error{Code: schemas.CodeProvider, Message: "x"}
		toError(Retryable(orig)).Message = "changed"
		toError(orig).Message = "changed"
		if orig.Message != "x" || orig.Retryable {
			t.Errorf("toError changed its argument: %+v", orig)
		}
	})
}

func TestRetryWrappers(t *testing.T) {
	t.Parallel()
	if NonRetryable(nil) != nil || Retryable(nil) != nil {
		t.Error("wrapping nil must give nil, so `return out, NonRetryable(err)` is safe")
	}
	for _, wrap := range []func(error) error{NonRetryable, Retryable} {
		err := wrap(io.ErrUnexpectedEOF)
		if !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("%v does not unwrap to its cause", err)
		}
		if err.Error() != io.ErrUnexpectedEOF.Error() {
			t.Errorf("Error() = %q, want the cause's message", err.Error())
		}
	}
}

func TestPrepDecode(t *testing.T) {
	t.Parallel()
	def := parseDef(t, `
name: decode
version: 1
steps:
  - id: a
    kind: noop
    with: {output: {x: 1}}
  - id: typo
    kind: noop
    with: {outptu: {x: 1}}
  - id: bare
    kind: noop
`)
	tests := []struct {
		step    string
		want    string
		wantErr string
	}{
		{step: "a", want: `{"x":1}`},
		{step: "bare", want: `{}`},
		{step: "typo", wantErr: `steps[1] (typo).with: json: unknown field "outptu"`},
	}
	for _, tt := range tests {
		t.Run(tt.step, func(t *testing.T) {
			t.Parallel()
			r, err := prepareStep(t, def, tt.step, nil)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Prepare = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			out, err := r.Run(t.Context(), newCall(def, tt.step, `{}`))
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := json.Marshal(out)
			if string(raw) != tt.want {
				t.Errorf("output = %s, want %s", raw, tt.want)
			}
		})
	}
}

func TestCallTemplateData(t *testing.T) {
	t.Parallel()
	def := parseDef(t, "name: td\nversion: 1\nsteps: [{id: s, kind: noop}]\n")
	c := newCall(def, "s", `{"n": 2, "who": "ada"}`)
	c.RunAttempt = 3
	c.Vars = map[string]string{"tone": "dry"}
	data, err := c.TemplateData()
	if err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(data)
	want := `{"attempt":3,"idempotency_key":"job-1/s/run-1","job":"job-1","state":{"n":2,"who":"ada"},"step":"s","vars":{"tone":"dry"}}`
	if string(got) != want {
		t.Errorf("TemplateData = %s, want %s", got, want)
	}

	tests := []struct {
		name, state, want, wantErr string
	}{
		{name: "null state", state: `null`, want: `{}`},
		{name: "not JSON", state: `{`, wantErr: "decode state of job job-1"},
		{name: "not an object", state: `[1]`, wantErr: "decode state of job job-1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			m, err := newCall(def, "s", tt.state).StateMap()
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("StateMap = %v, %v; want an error containing %q", m, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got, _ := json.Marshal(m); string(got) != tt.want {
				t.Errorf("StateMap = %s, want %s", got, tt.want)
			}
		})
	}
}
