package steps

import (
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/waymark-dev/waymark/schemas"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
	)
}

// parseDef loads a workflow written in YAML through the real loader, with
// assets read from testdata.
func parseDef(t testing.TB, src string) *schemas.Definition {
	t.Helper()
	def, err := schemas.Parse(t.Name()+".yaml", []byte(src), schemas.LoadOptions{BaseDir: "testdata"})
	if err != nil {
		t.Fatalf("parse definition: %v", err)
	}
	return def
}

// prepareStep prepares step id of def with the built-in kinds, as a worker
// (or the loader's Check) would.
func prepareStep(t testing.TB, def *schemas.Definition, id string, env *Env) (Runner, error) {
	t.Helper()
	idx := def.StepIndex(id)
	if idx < 0 {
		t.Fatalf("definition has no step %q", id)
	}
	kind, ok := Builtins().Lookup(def.Steps[idx].Kind)
	if !ok {
		t.Fatalf("no built-in kind %q", def.Steps[idx].Kind)
	}
	return kind.Prepare(&Prep{Definition: def, Step: &def.Steps[idx], Index: idx, Env: env})
}

// mustPrepare is prepareStep that fails the test on an error.
func mustPrepare(t testing.TB, def *schemas.Definition, id string, env *Env) Runner {
	t.Helper()
	r, err := prepareStep(t, def, id, env)
	if err != nil {
		t.Fatalf("prepare %s: %v", id, err)
	}
	return r
}

// newCall is the first attempt of step id over state, as the worker-less
// API builds it: no logger, no vars unless given.
func newCall(def *schemas.Definition, id, state string) *Call {
	return &Call{
		Job:            "job-1",
		Step:           def.Step(id),
		Definition:     def,
		Attempt:        1,
		RunAttempt:     1,
		State:          []byte(state),
		IdempotencyKey: "job-1/" + id + "/run-1",
	}
}

// wantStepError checks that err, as a result would carry it, has code and
// retryability, and that its message holds every one of contains.
func wantStepError(t testing.TB, err error, code schemas.Code, retryable bool, contains ...string) *schemas.Error {
	t.Helper()
	if err == nil {
		t.Fatalf("err = nil, want %s (retryable %v)", code, retryable)
	}
	e := toError(err)
	if e.Code != code || e.Retryable != retryable {
		t.Fatalf("err = %v (code %s, retryable %v), want code %s, retryable %v", err, e.Code, e.Retryable, code, retryable)
	}
	for _, s := range contains {
		if !strings.Contains(e.Message, s) {
			t.Errorf("message %q does not contain %q", e.Message, s)
		}
	}
	return e
}
