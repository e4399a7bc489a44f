package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/api"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

const threeSteps = `
name: three
version: 1
input_schema: {type: object, required: [n], properties: {n: {type: integer}}}
steps:
  - id: a
    kind: noop
    save_as: a
    next: [{to: b}]
  - id: b
    kind: noop
    save_as: b
    next:
      - {to: big, when: "state.n > 10"}
      - {to: c}
  - id: big
    kind: noop
    save_as: big
  - id: c
    kind: noop
    save_as: c
`

// setup starts a server, an engine and a worker, and returns a client.
func setup(t *testing.T) *client.Client {
	t.Helper()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	st := srv.Store(t, kv.Config{InboxAckWait: 2 * time.Second, WorkAckWait: 2 * time.Second})
	e, err := engine.New(engine.Config{Store: st, ReconcileInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	w, err := steps.NewWorker(steps.WorkerConfig{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{e.Run, w.Run} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(ctx); err != nil {
				t.Errorf("run: %v", err)
			}
		}()
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	return client.New(st)
}

func TestHTTPAPI(t *testing.T) {
	t.Parallel()
	c := setup(t)
	srv := httptest.NewServer((&api.API{Client: c, Checks: []schemas.CheckFunc{engine.Check}}).Handler())
	t.Cleanup(srv.Close)
	do := jsonDo(t, srv)

	code, m := do("POST", "/v1/workflows", threeSteps)
	if code != http.StatusCreated || m["name"] != "three" || len(m["hash"].(string)) != 64 {
		t.Fatalf("store workflow: %d %v", code, m)
	}
	code, m = do("POST", "/v1/workflows", "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    next: [{to: b}]\n")
	if code != http.StatusBadRequest || !strings.Contains(toJSON(m), `"line": 6`) || !strings.Contains(toJSON(m), `steps[0].next[0].to`) &&
		!strings.Contains(toJSON(m), `/steps/0/next/0/to`) {
		t.Errorf("bad workflow: %d %s", code, toJSON(m))
	}

	code, m = do("POST", "/v1/jobs", `{"workflow": "three", "input": {"n": 2}, "job_id": "api-1"}`)
	if code != http.StatusCreated || m["job_id"] != "api-1" {
		t.Fatalf("start: %d %v", code, m)
	}
	code, m = do("POST", "/v1/jobs", `{"workflow": "three", "input": {"n": 2}, "job_id": "api-1"}`)
	if code != http.StatusOK || m["attached"] != true {
		t.Errorf("start again: %d %v, want 200 attached", code, m)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		_, m = do("GET", "/v1/jobs/api-1", "")
		return m["status"] == string(schemas.JobCompleted)
	}, "job never completed: %v", m)
	if steps := m["steps"].([]any); len(steps) != 4 {
		t.Errorf("steps = %v", steps)
	}
	// Answers keep HTML as it was given (a JSON encoder's default would
	// send "<" as \u003c).
	resp, err := srv.Client().Get(srv.URL + "/v1/jobs/%3Cb%3E&")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(raw), `\"<b>&\"`) {
		t.Errorf("answer for job <b>&: %s; want the id as given, unescaped", raw)
	}

	// Cancel: a completed job is left as it is (409 with its record); a
	// job whose step no worker can run is cancelled.
	code, m = do("POST", "/v1/jobs/api-1/cancel", `{"by": "ops"}`)
	if code != http.StatusConflict || m["status"] != string(schemas.JobCompleted) {
		t.Errorf("cancel of a completed job: %d %v", code, m)
	}
	code, m = do("POST", "/v1/workflows", "name: stuck\nversion: 1\nsteps:\n  - {id: a, kind: nobody-runs-this}\n")
	if code != http.StatusCreated {
		t.Fatalf("store workflow: %d %v", code, m)
	}
	if code, m = do("POST", "/v1/jobs", `{"workflow": "stuck", "input": {}, "job_id": "api-stuck"}`); code != http.StatusCreated {
		t.Fatalf("start: %d %v", code, m)
	}
	code, m = do("POST", "/v1/jobs/api-stuck/cancel", `{"by": "ops", "reason": "nobody runs it"}`)
	if e, _ := m["error"].(map[string]any); code != http.StatusOK || m["status"] != string(schemas.JobCancelled) || e["message"] != "by ops: nobody runs it" {
		t.Errorf("cancel: %d %v", code, m)
	}

	for _, tc := range []struct {
		method, path, body string
		want               int
		code               string
		msg                []string // all must appear in the message
	}{
		{"POST", "/v1/jobs/api-1/cancel", `{"reason": "x"}`, 400, "input_invalid", []string{"say who cancels it"}},
		{"POST", "/v1/jobs/api-1/cancel", `{"by": "x", "why": "y"}`, 400, "input_invalid", []string{"why"}},
		{"POST", "/v1/jobs/no-such-job/cancel", `{"by": "x"}`, 404, "not_found", nil},
		{"POST", "/v1/jobs", `{"workflow": "three", "input": {"n": "x"}}`, 400, "input_invalid", nil},
		{"POST", "/v1/jobs", `{"workflow": "nope", "input": {}}`, 404, "not_found", nil},
		{"POST", "/v1/jobs", `{"input": {}}`, 400, "input_invalid", nil},
		{"POST", "/v1/jobs", `{"workflow": "three", "input": {"n": 1}, "job_id": "bad id"}`, 400, "input_invalid", nil},
		{"POST", "/v1/jobs", `{"workflow": "three", "unknown": 1}`, 400, "input_invalid", []string{`unknown field "unknown"`}},
		{"POST", "/v1/jobs", `[1]`, 400, "input_invalid", []string{"want an object, got a JSON array"}},
		{"POST", "/v1/jobs", ``, 400, "input_invalid", []string{"empty; send a JSON object"}},
		{"POST", "/v1/effects/resolve", `{"key": "j/notify", "happened": "yes", "by": "a"}`, 400, "input_invalid", []string{`field "happened": want true or false, got a JSON string`}},
		{"POST", "/v1/jobs", `{"workflow": "three", "input": {"n": 1}}{"x": 1}`, 400, "input_invalid", []string{"more follows the JSON object"}},
		{"POST", "/v1/jobs", "\xef\xbb\xbf" + `{"workflow": "three", "input": {"n": 1}}`, 400, "input_invalid", []string{"byte order mark"}},
		{"POST", "/v1/effects/resolve", `{"key": "j/notify", "happened": true, "by": "a"} x`, 400, "input_invalid", []string{"more follows"}},
		{"GET", "/v1/jobs?workflow=*", "", 400, "input_invalid", []string{"not a workflow name"}},
		{"GET", "/v1/jobs?after=99999999.99999999", "", 400, "input_invalid", []string{"cursor"}},
		{"GET", "/v1/jobs/absent", "", 404, "not_found", []string{`no job "absent"`}},
		{"GET", "/v1/jobs/bad%20id!", "", 400, "input_invalid", []string{`job id "bad id!"`}},
		{"GET", "/v1/effects?job=bad%20id!", "", 400, "input_invalid", []string{`job id "bad id!"`}},
		{"GET", "/v1/jobs/absent/history", "", 404, "not_found", nil},
		{"GET", "/v1/jobs?limit=0", "", 400, "input_invalid", nil},
		{"GET", "/v1/jobs?status=bogus", "", 400, "input_invalid",
			[]string{`status "bogus"`, "pending, running, completed, failed, cancelled, needs_reconciliation, blocked, quarantined, waiting_approval"}},
		{"GET", "/v1/effects?state=bogus", "", 400, "input_invalid",
			[]string{`state "bogus"`, "prepared, dispatched, confirmed, ambiguous, reconciled"}},
		{"POST", "/v1/effects/resolve", `{"key": "j/notify", "by": "a"}`, 400, "input_invalid", []string{"happened is required", "true", "false"}},
		{"POST", "/v1/effects/resolve", `{"key": "j/notify", "happened": null, "by": "a"}`, 400, "input_invalid", []string{"happened is required"}},
		{"POST", "/v1/effects/resolve", `{"key": "j/notify", "happened": false, "by": "a"}`, 404, "not_found", nil},
		{"POST", "/v1/effects/resolve", `{"happened": true, "by": "a"}`, 400, "input_invalid", []string{"key is required"}},
		{"GET", "/v1/nothing", "", 404, "not_found", nil},
		{"DELETE", "/v1/jobs/api-1", "", 405, "method_not_allowed", nil},
	} {
		code, m := do(tc.method, tc.path, tc.body)
		e, _ := m["error"].(map[string]any)
		msg, _ := e["message"].(string)
		if code != tc.want || e["code"] != tc.code || msg == "" {
			t.Errorf("%s %s %s: %d %v, want %d %s", tc.method, tc.path, tc.body, code, m, tc.want, tc.code)
		}
		if strings.Contains(msg, tc.code+": ") {
			t.Errorf("%s %s %s: message %q repeats the code", tc.method, tc.path, tc.body, msg)
		}
		for _, w := range tc.msg {
			if !strings.Contains(msg, w) {
				t.Errorf("%s %s %s: message %q lacks %q", tc.method, tc.path, tc.body, msg, w)
			}
		}
	}

	// The index entry of an ended job follows its last checkpoint.
	testsupport.Eventually(t, 20*time.Second, func() bool {
		code, m = do("GET", "/v1/jobs?status=completed", "")
		jobs, _ := m["jobs"].([]any)
		return code == 200 && len(jobs) == 1
	}, "list: %d %v", code, m)
	code, m = do("GET", "/v1/jobs/api-1/history", "")
	if evs := m["events"].([]any); code != 200 || len(evs) != 6 { // started, dispatched a, completed a, b and c, job completed
		t.Errorf("history: %d %d events", code, len(evs))
	}
}

// jsonDo returns a function that sends method path body to srv and
// returns the status and the JSON object answered (failing t on any other
// answer).
func jsonDo(t *testing.T, srv *httptest.Server) func(method, path, body string) (int, map[string]any) {
	return func(method, path, body string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatalf("%s %s: not JSON: %s", method, path, raw)
		}
		return resp.StatusCode, m
	}
}

func toJSON(v any) string {
	b, _ := json.MarshalIndent(v, "", "  ")
	return string(b)
}

// TestHTTPControlAndApprovals: approve and reject answer 403 for someone
// not named, 404 for a gate the job does not have, 200 with the record
// once decided and 409 when decided already; pause, resume and retry
// answer 409 for a job they do not apply to and 400 for fields that are
// not theirs.
func TestHTTPControlAndApprovals(t *testing.T) {
	t.Parallel()
	c := setup(t)
	srv := httptest.NewServer((&api.API{Client: c, Checks: []schemas.CheckFunc{engine.Check}}).Handler())
	t.Cleanup(srv.Close)
	do := jsonDo(t, srv)
	wf := "name: gated\nversion: 1\nsteps:\n  - {id: ok, kind: approval, with: {action: ship, approvers: [alice]}, next: [{to: ship}]}\n  - {id: ship, kind: noop}\n"
	if code, m := do("POST", "/v1/workflows", wf); code != http.StatusCreated {
		t.Fatalf("store workflow: %d %v", code, m)
	}
	if code, m := do("POST", "/v1/jobs", `{"workflow": "gated", "input": {}, "job_id": "api-gate"}`); code != http.StatusCreated {
		t.Fatalf("start: %d %v", code, m)
	}
	var m map[string]any
	testsupport.Eventually(t, 20*time.Second, func() bool {
		_, m = do("GET", "/v1/jobs/api-gate", "")
		return m["status"] == string(schemas.JobWaitingApproval)
	}, "job never waited for its approval: %v", m)
	gates, _ := m["approvals"].([]any)
	if len(gates) != 1 || gates[0].(map[string]any)["gate"] != "ok" || gates[0].(map[string]any)["status"] != "pending" || len(gates[0].(map[string]any)["digest"].(string)) != 64 {
		t.Fatalf("approvals %v", m["approvals"])
	}
	for _, tc := range []struct {
		path, body string
		want       int
		code       string
	}{
		{"/v1/jobs/api-gate/approvals/ok/approve", `{"by": "bob"}`, 403, "forbidden"},
		{"/v1/jobs/api-gate/approvals/ship/approve", `{"by": "alice"}`, 404, "not_found"},
		{"/v1/jobs/api-gate/approvals/ok/approve", `{"by": "alice", "digest": "00"}`, 400, "input_invalid"},
		{"/v1/jobs/api-gate/approvals/ok/approve", `{"by": "alice", "digest": "` + strings.Repeat("0", 64) + `"}`, 409, "conflict"},
		{"/v1/jobs/api-gate/approvals/ok/approve", `{"by": "alice", "from": "x"}`, 400, "input_invalid"},
		{"/v1/jobs/api-gate/resume", `{"by": "ops"}`, 409, "conflict"},
		{"/v1/jobs/api-gate/retry", `{"by": "ops"}`, 409, "conflict"},
		{"/v1/jobs/api-gate/pause", `{"by": "ops", "from": "ok"}`, 400, "input_invalid"},
		{"/v1/jobs/api-gate/pause", `{}`, 400, "input_invalid"},
		{"/v1/jobs/nobody/pause", `{"by": "ops"}`, 404, "not_found"},
	} {
		code, m := do("POST", tc.path, tc.body)
		if e, _ := m["error"].(map[string]any); code != tc.want || e["code"] != tc.code {
			t.Errorf("POST %s %s: %d %v, want %d %s", tc.path, tc.body, code, m, tc.want, tc.code)
		}
	}
	code, m := do("POST", "/v1/jobs/api-gate/approvals/ok/approve", `{"by": "alice", "reason": "looks right"}`)
	if code != http.StatusOK || m["approvals"].([]any)[0].(map[string]any)["status"] != "approved" {
		t.Fatalf("approve: %d %v", code, m)
	}
	if code, m := do("POST", "/v1/jobs/api-gate/approvals/ok/reject", `{"by": "alice"}`); code != http.StatusConflict || !strings.Contains(toJSON(m), "already decided") {
		t.Errorf("reject after approve: %d %v", code, m)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		_, m = do("GET", "/v1/jobs/api-gate", "")
		return m["status"] == string(schemas.JobCompleted)
	}, "job never completed: %v", m)
	if code, m := do("POST", "/v1/jobs/api-gate/pause", `{"by": "ops"}`); code != http.StatusConflict {
		t.Errorf("pause of a completed job: %d %v", code, m)
	}
	// Time travel: the job at its gate (seq 2), then a fork from there.
	if code, m := do("GET", "/v1/jobs/api-gate/at/2", ""); code != http.StatusOK || m["next"] != "ok" || m["status"] != "waiting_approval" {
		t.Errorf("at seq 2: %d %v", code, m)
	}
	for _, tc := range []struct {
		method, path, body string
		want               int
	}{
		{"GET", "/v1/jobs/api-gate/at/99", "", 400},
		{"GET", "/v1/jobs/api-gate/at/x", "", 400},
		{"GET", "/v1/jobs/nobody/at/1", "", 404},
		{"POST", "/v1/jobs/api-gate/fork", `{"from": 2, "by": "ops", "set": {"a..b": 1}}`, 400},
		{"POST", "/v1/jobs/api-gate/fork", `{"from": 2}`, 400},
		{"POST", "/v1/jobs/api-gate/rewind", `{"to": 1, "by": "ops"}`, 400},
	} {
		if code, m := do(tc.method, tc.path, tc.body); code != tc.want {
			t.Errorf("%s %s %s: %d %v, want %d", tc.method, tc.path, tc.body, code, m, tc.want)
		}
	}
	code, m = do("POST", "/v1/jobs/api-gate/fork", `{"from": 2, "by": "ops", "job_id": "api-gate-fork"}`)
	if code != http.StatusCreated || m["job_id"] != "api-gate-fork" {
		t.Fatalf("fork: %d %v", code, m)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		_, m = do("GET", "/v1/jobs/api-gate-fork", "")
		return m["status"] == string(schemas.JobWaitingApproval)
	}, "the fork never reached its gate: %v", m)
	code, m = do("POST", "/v1/jobs/api-gate/rewind", `{"to": 2, "by": "ops", "reason": "again"}`)
	if job, _ := m["job"].(map[string]any); code != http.StatusOK || job["status"] != string(schemas.JobWaitingApproval) {
		t.Fatalf("rewind: %d %v", code, m)
	}
}

// TestHTTPSignals: a signal with start creates the job and its wait step
// takes the signal; data breaking the schema is 400, a name no wait step
// has 404, a signal to an ended job 409.
func TestHTTPSignals(t *testing.T) {
	t.Parallel()
	c := setup(t)
	srv := httptest.NewServer((&api.API{Client: c, Checks: []schemas.CheckFunc{engine.Check}}).Handler())
	t.Cleanup(srv.Close)
	call := jsonDo(t, srv)
	do := func(path, body string) (int, map[string]any) { t.Helper(); return call("POST", path, body) }
	wf := "name: waits\nversion: 1\nsteps:\n  - {id: w, kind: wait, with: {signal: go, schema: {type: object, required: [n]}}, save_as: got}\n"
	if code, m := do("/v1/workflows", wf); code != http.StatusCreated {
		t.Fatalf("store workflow: %d %v", code, m)
	}
	for _, tc := range []struct {
		path, body string
		want       int
		code       string
	}{
		{"/v1/jobs/sig-1/signals/go", `{"by": "hook", "data": {"n": 1}}`, 404, "not_found"}, // no such job, no start
		{"/v1/jobs/sig-1/signals/go", `{"by": "hook", "start": {}}`, 400, "input_invalid"},
		{"/v1/jobs/sig-1/signals/go", `{"by": "hook", "start": {"workflow": "nope"}}`, 404, "not_found"},
		{"/v1/jobs/sig-1/signals/go", `{"by": "hook", "data": {"m": 1}, "start": {"workflow": "waits"}}`, 400, "input_invalid"},
		{"/v1/jobs/sig-1/signals/stop", `{"by": "hook"}`, 404, "not_found"},
		{"/v1/jobs/sig-1/signals/bad%20name", `{"by": "hook"}`, 400, "input_invalid"},
		{"/v1/jobs/sig-1/signals/go", `{"by": "hook", "extra": 1}`, 400, "input_invalid"},
	} {
		code, m := do(tc.path, tc.body)
		if e, _ := m["error"].(map[string]any); code != tc.want || e["code"] != tc.code {
			t.Errorf("POST %s %s: %d %v, want %d %s", tc.path, tc.body, code, m, tc.want, tc.code)
		}
	}
	code, m := do("/v1/jobs/sig-1/signals/go", `{"by": "hook", "id": "evt-1", "data": {"n": 1}, "start": {"workflow": "waits"}}`)
	if sig, _ := m["signal"].(map[string]any); code != http.StatusOK || sig["taken"] != "w" {
		t.Fatalf("signal with start: %d %v", code, m)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		resp, err := srv.Client().Get(srv.URL + "/v1/jobs/sig-1")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		_ = json.NewDecoder(resp.Body).Decode(&m)
		return m["status"] == string(schemas.JobCompleted)
	}, "the job never completed: %v", m)
	if code, m := do("/v1/jobs/sig-1/signals/go", `{"by": "hook", "data": {"n": 2}}`); code != http.StatusConflict {
		t.Errorf("signal to an ended job: %d %v", code, m)
	}
}

// TestRetryDoesNotRepeatAConfirmedEffect: a job retried from a step whose
// effect the ledger holds as confirmed is answered from the ledger: the
// provider is called once, however often the job is retried; a gate
// reached again after a retry is a new gate, decided on its own.
func TestRetryDoesNotRepeatAConfirmedEffect(t *testing.T) {
	t.Parallel()
	c := setup(t)
	var calls sync.Map
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := calls.LoadOrStore(r.Header.Get("Idempotency-Key"), new(int))
		*n.(*int)++
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id": "ch_1"}`)
	}))
	t.Cleanup(provider.Close)
	def, err := schemas.Parse("retry.yaml", []byte(`
name: payfail
version: 1
steps:
  - id: gate
    kind: approval
    with: {action: pay}
    next: [{to: pay}]
  - id: pay
    kind: http
    effect: idempotent
    with: {method: POST, url: '`+provider.URL+`/charge', body: {n: 1}}
    next: [{to: boom}]
  - {id: boom, kind: noop, next: [{fail: boom, when: "true"}]}
`), schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := c.Start(ctx, def, json.RawMessage(`{}`), client.StartOptions{JobID: "pf-1"}); err != nil {
		t.Fatal(err)
	}
	waitFor := func(st schemas.JobStatus) *client.JobView {
		t.Helper()
		var v *client.JobView
		testsupport.Eventually(t, 20*time.Second, func() bool {
			v, _ = c.Job(ctx, "pf-1")
			return v != nil && v.Status == st
		}, "job pf-1 never %s: %+v", st, v)
		return v
	}
	waitFor(schemas.JobWaitingApproval)
	if _, err := c.Reject(ctx, "pf-1", "gate", client.ControlRequest{By: "bob"}); err != nil {
		t.Fatal(err)
	}
	waitFor(schemas.JobFailed)
	if _, err := c.Retry(ctx, "pf-1", client.ControlRequest{By: "ops"}); err != nil {
		t.Fatal(err)
	}
	v := waitFor(schemas.JobWaitingApproval)
	if len(v.Approvals) != 2 || v.Approvals[0].Status != schemas.ApprovalRejected || v.Approvals[1].ID != "gate/1.2" || v.Approvals[1].Status != schemas.ApprovalPending {
		t.Fatalf("gates after the retry: %+v", v.Approvals)
	}
	if _, err := c.Approve(ctx, "pf-1", "gate", client.ControlRequest{By: "alice", Digest: v.Approvals[1].Digest}); err != nil {
		t.Fatal(err)
	}
	waitFor(schemas.JobFailed) // pay confirmed, then boom
	for range 2 {
		if _, err := c.Retry(ctx, "pf-1", client.ControlRequest{By: "ops", From: "pay"}); err != nil {
			t.Fatal(err)
		}
		waitFor(schemas.JobFailed)
	}
	n := 0
	calls.Range(func(k, v any) bool { n += *v.(*int); return true })
	if n != 1 {
		t.Fatalf("the provider was called %d times, want 1", n)
	}
	v, _ = c.Job(ctx, "pf-1")
	if v.Retries != 3 || v.Approvals[1].Status != schemas.ApprovalApproved || v.Approvals[1].DecidedBy != "alice" {
		t.Fatalf("retries %d approvals %+v", v.Retries, v.Approvals)
	}
	// Rewound to where pay was in flight: the rewind lists pay's confirmed
	// effect (settled after that point), and running pay again calls no one.
	var at uint64
	for seq := uint64(1); seq <= v.Seq && at == 0; seq++ {
		if s, err := c.StateAt(ctx, "pf-1", seq); err == nil && s.Next == "pay" {
			at = seq
		}
	}
	res, err := c.Rewind(ctx, "pf-1", at, client.ControlRequest{By: "ops"})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Snapshot.EffectsAfter) != 1 || res.Snapshot.EffectsAfter[0].Key != "pf-1/pay" || res.Snapshot.EffectsAfter[0].State != string(schemas.EffectConfirmed) {
		t.Fatalf("effects after seq %d: %+v", at, res.Snapshot.EffectsAfter)
	}
	waitFor(schemas.JobFailed)
	n = 0
	calls.Range(func(k, v any) bool { n += *v.(*int); return true })
	if n != 1 {
		t.Fatalf("after the rewind the provider was called %d times, want 1", n)
	}
}

// TestScopedApprovalIsCheckedWhenTheEffectRuns: an approval of "charges up
// to 40 EUR" covers the charge step; a job whose amount grew after the
// approval sends no charge (approval_scope, not performed); one within the
// scope is charged.
func TestScopedApprovalIsCheckedWhenTheEffectRuns(t *testing.T) {
	t.Parallel()
	c := setup(t)
	var calls atomic.Int64
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id": "ch_1"}`)
	}))
	t.Cleanup(provider.Close)
	def, err := schemas.Parse("scoped.yaml", []byte(`
name: scoped
version: 1
steps:
  - id: approve
    kind: approval
    with:
      action: 'charge {{.state.amount_cents}} cents'
      scope: {steps: [charge], when: 'request.body.amount_cents <= 4000 && request.body.customer == "C1"'}
    next: [{to: grow, when: 'state.grow'}, {to: charge}]
  - {id: grow, kind: noop, with: {output: {amount_cents: 5000}}, next: [{to: charge}]}
  - id: charge
    kind: http
    effect: idempotent
    with: {method: POST, url: '`+provider.URL+`/charge', body: {amount_cents: '{{json .state.amount_cents}}', customer: '{{.state.customer}}'}}
`), schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	run := func(id, input string) *client.JobView {
		t.Helper()
		if _, err := c.Start(ctx, def, json.RawMessage(input), client.StartOptions{JobID: id}); err != nil {
			t.Fatal(err)
		}
		var v *client.JobView
		testsupport.Eventually(t, 20*time.Second, func() bool { v, _ = c.Job(ctx, id); return v != nil && v.Status == schemas.JobWaitingApproval }, "no gate: %+v", v)
		if _, err := c.Approve(ctx, id, "approve", client.ControlRequest{By: "alice"}); err != nil {
			t.Fatal(err)
		}
		testsupport.Eventually(t, 20*time.Second, func() bool { v, _ = c.Job(ctx, id); return v != nil && v.Status.Terminal() }, "never ended: %+v", v)
		return v
	}
	grown := run("scope-grown", `{"amount_cents": 4000, "customer": "C1", "grow": true}`)
	if grown.Status != schemas.JobFailed || grown.Error == nil || grown.Error.Code != schemas.CodeApprovalScope || !strings.Contains(grown.Error.Message, "outside the scope") || calls.Load() != 0 {
		t.Fatalf("grown past its scope: %s %+v, %d calls", grown.Status, grown.Error, calls.Load())
	}
	ok := run("scope-ok", `{"amount_cents": 4000, "customer": "C1", "grow": false}`)
	if ok.Status != schemas.JobCompleted || calls.Load() != 1 {
		t.Fatalf("within its scope: %s %+v, %d calls", ok.Status, ok.Error, calls.Load())
	}
}

// TestSessionStoreAcrossJobs: one job writes a user's memory with store
// steps, another reads it; a create-only write over a value fails the job
// with code conflict, not retried.
func TestSessionStoreAcrossJobs(t *testing.T) {
	t.Parallel()
	c := setup(t)
	def, err := schemas.Parse("memory.yaml", []byte(`
name: memory
version: 1
steps:
  - id: read
    kind: store
    with: {op: get, namespace: 'user-{{.state.user}}', key: prefs}
    save_as: before
    next: [{to: write}]
  - id: write
    kind: store
    effect: idempotent
    with: {op: put, namespace: 'user-{{.state.user}}', key: prefs, value: {lang: '{{.state.lang}}'}, expect_revision: '{{.state.expect}}'}
    save_as: written
`), schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().Check(&steps.Env{})}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	run := func(id, input string) *client.JobView {
		t.Helper()
		if _, err := c.Start(ctx, def, json.RawMessage(input), client.StartOptions{JobID: id}); err != nil {
			t.Fatal(err)
		}
		var v *client.JobView
		testsupport.Eventually(t, 20*time.Second, func() bool { v, _ = c.Job(ctx, id); return v != nil && v.Status.Terminal() }, "never ended: %+v", v)
		return v
	}
	first := run("mem-1", `{"user": "u1", "lang": "fr", "expect": "0"}`)
	if first.Status != schemas.JobCompleted || !strings.Contains(string(first.State), `"before":{"found":false`) {
		t.Fatalf("first: %s %s %+v", first.Status, first.State, first.Error)
	}
	second := run("mem-2", `{"user": "u1", "lang": "de", "expect": "0"}`)
	if second.Status != schemas.JobFailed || second.Error.Code != schemas.CodeConflict || !strings.Contains(string(second.State), `"value":{"lang":"fr"}`) {
		t.Fatalf("second: %s %s %+v", second.Status, second.State, second.Error)
	}
	e, err := c.Store().Session.Get(ctx, "u1-nope", "prefs")
	if !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("another namespace: %+v %v", e, err)
	}
	if e, err := c.Store().Session.Get(ctx, "user-u1", "prefs"); err != nil || string(e.Value) != `{"lang":"fr"}` {
		t.Fatalf("stored: %+v %v", e, err)
	}
	srv := httptest.NewServer((&api.API{Client: c}).Handler())
	t.Cleanup(srv.Close)
	do := func(method, path, body string) int {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		method, path, body string
		want               int
	}{
		{"GET", "/v1/store/user-u1/prefs", "", 200},
		{"GET", "/v1/store/user-u1", "", 200},
		{"GET", "/v1/store/user-u1/nope", "", 404},
		{"PUT", "/v1/store/user-u1/prefs?create=true", `{"lang":"it"}`, 409},
		{"PUT", "/v1/store/user-u1/prefs?revision=9999", `{"lang":"it"}`, 409},
		{"PUT", "/v1/store/user.u1/prefs", `1`, 400},
		{"PUT", "/v1/store/user-u1/prefs", `not json`, 400},
		{"PUT", "/v1/store/user-u1/other", `{"n":1}`, 200},
		{"DELETE", "/v1/store/user-u1/other?revision=9999", "", 409},
		{"DELETE", "/v1/store/user-u1/other", "", 204},
	} {
		if got := do(tc.method, tc.path, tc.body); got != tc.want {
			t.Errorf("%s %s %s: %d, want %d", tc.method, tc.path, tc.body, got, tc.want)
		}
	}
}

// TestStoreAndScopeChecksAtLoad: a store step writing a secret and a scope
// over a step that is not http are refused when the workflow is loaded.
func TestStoreAndScopeChecksAtLoad(t *testing.T) {
	t.Parallel()
	checks := []schemas.CheckFunc{engine.Check, steps.Builtins().Check(&steps.Env{})}
	for _, tc := range []struct{ yaml, want string }{
		{"name: s\nversion: 1\nsteps:\n  - {id: w, kind: store, with: {op: put, namespace: n, key: k, value: {s: '{{secret \"api\"}}'}}}\n",
			"{{secret}} is not allowed in a store step"},
		{"name: s\nversion: 1\nsteps:\n  - {id: g, kind: approval, with: {scope: {steps: [n], when: 'request.body.x < 1'}}, next: [{to: n}]}\n  - {id: n, kind: noop}\n",
			"a scope bounds the requests of http steps"},
	} {
		_, err := schemas.Parse("check.yaml", []byte(tc.yaml), schemas.LoadOptions{Checks: checks})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.yaml, err, tc.want)
		}
	}
}
