package api_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/api"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// serviceAnswer is one answer of the job control service: the error code
// and description of micro's headers ("" on success) and the JSON data.
type serviceAnswer struct {
	code, desc string
	data       map[string]any
	raw        []byte
}

// startService runs an engine on an embedded server, the job control
// service on the engine's store connection, and returns the client, a
// connection of its own and a call function that requests over it.
func startService(t *testing.T) (*client.Client, *nats.Conn, func(subject, body string) serviceAnswer) {
	t.Helper()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	st := srv.Store(t, kv.Config{InboxAckWait: 2 * time.Second, WorkAckWait: 2 * time.Second})
	e, err := engine.New(engine.Config{Store: st, ReconcileInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := e.Run(ctx); err != nil {
			t.Errorf("engine: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	c := client.New(st)
	svc, err := api.StartService(st.JS.Conn(), c, "", "dev", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Stop() })
	nc := srv.Conn(t)
	call := func(subject, body string) serviceAnswer {
		t.Helper()
		msg, err := nc.Request(subject, []byte(body), api.ServiceTimeout+10*time.Second)
		if err != nil {
			t.Fatalf("request %s %s: %v", subject, body, err)
		}
		a := serviceAnswer{code: msg.Header.Get(micro.ErrorCodeHeader), desc: msg.Header.Get(micro.ErrorHeader), raw: msg.Data}
		if err := json.Unmarshal(msg.Data, &a.data); err != nil {
			t.Fatalf("request %s %s: answer not a JSON object: %q", subject, body, msg.Data)
		}
		return a
	}
	return c, nc, call
}

// errCode is the "error"."code" of an error answer's data.
func (a serviceAnswer) errCode() any {
	e, _ := a.data["error"].(map[string]any)
	return e["code"]
}

// TestServiceDiscoverable: the NATS service API's PING and INFO answer
// for "waymark" with its eight job endpoints under waymark.api.job.* in
// queue group "q"; a development build announces ServiceVersion and a
// semantic one its own version; another prefix moves the subjects.
func TestServiceDiscoverable(t *testing.T) {
	t.Parallel()
	c, nc, _ := startService(t)
	msg, err := nc.Request("$SRV.PING.waymark", nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var ping micro.Ping
	if err := json.Unmarshal(msg.Data, &ping); err != nil || ping.Name != api.ServiceName || ping.Type != micro.PingResponseType || ping.ID == "" {
		t.Fatalf("PING: %s (%v)", msg.Data, err)
	}
	msg, err = nc.Request("$SRV.INFO.waymark", nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var info micro.Info
	if err := json.Unmarshal(msg.Data, &info); err != nil {
		t.Fatalf("INFO: %s (%v)", msg.Data, err)
	}
	if info.Name != "waymark" || info.Version != api.ServiceVersion || info.Description == "" || info.Metadata["prefix"] != "waymark" || info.Metadata["build"] != "dev" {
		t.Errorf("INFO: %s", msg.Data)
	}
	var subjects []string
	for _, ep := range info.Endpoints {
		subjects = append(subjects, ep.Subject)
		if ep.QueueGroup != micro.DefaultQueueGroup || ep.Metadata["fields"] == "" || !strings.HasPrefix(ep.Metadata["fields"], "job") {
			t.Errorf("endpoint %s: queue group %q, metadata %v", ep.Name, ep.QueueGroup, ep.Metadata)
		}
	}
	want := []string{"waymark.api.job.get", "waymark.api.job.cancel", "waymark.api.job.pause", "waymark.api.job.resume",
		"waymark.api.job.retry", "waymark.api.job.approve", "waymark.api.job.reject", "waymark.api.job.signal"}
	if !slices.Equal(subjects, want) {
		t.Errorf("endpoint subjects %v, want %v", subjects, want)
	}

	other, err := api.StartService(c.Store().JS.Conn(), c, "acme", "v1.2.3", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Stop()
	if i := other.Info(); i.Version != "1.2.3" || i.Endpoints[0].Subject != "acme.api.job.get" {
		t.Errorf("prefix acme, version v1.2.3: version %s, first subject %s", i.Version, i.Endpoints[0].Subject)
	}
	if _, err := api.StartService(c.Store().JS.Conn(), c, "a.b", "dev", nil); err == nil {
		t.Error("prefix a.b: want an error (not one subject token)")
	}
}

// TestServiceBadRequests: an unknown job answers "404"; a field the
// endpoint does not take, bad JSON, a second value, a missing job, by or
// gate answer "400" naming what is wrong; no input makes a handler fail to
// answer (every one answers an error with the {"error": {code, message}}
// data) and the service keeps answering.
func TestServiceBadRequests(t *testing.T) {
	t.Parallel()
	_, _, call := startService(t)
	for _, tc := range []struct {
		subject, body string
		code          string
		errCode       string
		says          []string
	}{
		{"job.get", `{"job": "absent"}`, "404", "not_found", []string{"absent"}},
		{"job.pause", `{"job": "absent", "by": "ops"}`, "404", "not_found", nil},
		{"job.get", `{"job": "absent", "by": "ops"}`, "400", "input_invalid", []string{`unknown field "by"`, "job.get takes job"}},
		{"job.pause", `{"job": "x", "by": "ops", "from": "a"}`, "400", "input_invalid", []string{`unknown field "from"`}},
		{"job.retry", `{"job": "x", "by": "ops", "gate": "a"}`, "400", "input_invalid", []string{`unknown field "gate"`}},
		{"job.approve", `{"job": "x", "gate": "g", "by": "ops", "from": "a"}`, "400", "input_invalid", []string{`unknown field "from"`}},
		{"job.cancel", `{"job": "x", "by": "ops", "bogus": 1}`, "400", "input_invalid", []string{`unknown field "bogus"`}},
		{"job.get", `{"JOB": "x"}`, "400", "input_invalid", []string{`unknown field "JOB"`}},
		{"job.get", `{"job": `, "400", "input_invalid", []string{"not valid JSON"}},
		{"job.get", `{"job": "x"} {"job": "y"}`, "400", "input_invalid", []string{"more follows"}},
		{"job.get", ``, "400", "input_invalid", []string{"empty"}},
		{"job.get", `null`, "400", "input_invalid", []string{"JSON object"}},
		{"job.get", `[1]`, "400", "input_invalid", []string{"array"}},
		{"job.get", `{"job": 7}`, "400", "input_invalid", []string{`"job"`, "a string"}},
		{"job.get", `{}`, "400", "input_invalid", []string{"job is required"}},
		{"job.get", `{"job": "../etc"}`, "400", "input_invalid", []string{"job id"}},
		{"job.get", "{\"job\": \"\xff\"}", "400", "input_invalid", []string{"UTF-8"}},
		{"job.get", "\xef\xbb\xbf{\"job\": \"x\"}", "400", "input_invalid", []string{"byte order mark"}},
		{"job.pause", `{"job": "x"}`, "400", "input_invalid", []string{"by"}},
		{"job.cancel", `{"job": "x", "by": "a\nb"}`, "400", "input_invalid", []string{"control character"}},
		{"job.approve", `{"job": "x", "by": "ops"}`, "400", "input_invalid", []string{"gate is required"}},
		{"job.signal", `{"job": "x", "by": "ops"}`, "400", "input_invalid", []string{"name is required"}},
		{"job.signal", `{"job": "nobody", "name": "go", "by": "ops"}`, "404", "not_found", nil},
	} {
		a := call("waymark.api."+tc.subject, tc.body)
		if a.code != tc.code || a.errCode() != tc.errCode || a.desc == "" {
			t.Errorf("%s %q: code %q desc %q data %s; want %s %s", tc.subject, tc.body, a.code, a.desc, a.raw, tc.code, tc.errCode)
			continue
		}
		msg, _ := a.data["error"].(map[string]any)["message"].(string)
		for _, s := range tc.says {
			if !strings.Contains(msg, s) || !strings.Contains(a.desc, s) {
				t.Errorf("%s %q: message %q, description %q; want them to say %q", tc.subject, tc.body, msg, a.desc, s)
			}
		}
	}
}

// TestServiceControlAndApprovals drives a job waiting at an approval
// gate: pause answers its record paused and resume unpaused (a second
// resume "409"); approve by someone not named "403", of a gate it does
// not have "404", by alice the record with the gate approved, and the
// job completes; approving again "409" already decided; cancel of the
// completed job "409" with its record.
func TestServiceControlAndApprovals(t *testing.T) {
	t.Parallel()
	c, _, call := startService(t)
	def, err := schemas.Parse("gated.yaml", []byte("name: gated\nversion: 1\nsteps:\n  - {id: ok, kind: approval, with: {approvers: [alice]}}\n"), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Start(ctx, def, nil, client.StartOptions{JobID: "svc-gate"}); err != nil {
		t.Fatal(err)
	}
	var a serviceAnswer
	testsupport.Eventually(t, 20*time.Second, func() bool {
		a = call("waymark.api.job.get", `{"job": "svc-gate"}`)
		return a.data["status"] == string(schemas.JobWaitingApproval)
	}, "job never waited for its approval: %s", a.raw)

	a = call("waymark.api.job.pause", `{"job": "svc-gate", "by": "ops", "reason": "look first"}`)
	if p, _ := a.data["paused"].(map[string]any); a.code != "" || a.data["id"] != "svc-gate" || p["by"] != "ops" {
		t.Fatalf("pause: %q %s", a.code, a.raw)
	}
	if a = call("waymark.api.job.pause", `{"job": "svc-gate", "by": "ops"}`); a.code != "409" || a.errCode() != "conflict" {
		t.Errorf("pause again: %q %s, want 409 conflict", a.code, a.raw)
	}
	a = call("waymark.api.job.resume", `{"job": "svc-gate", "by": "ops"}`)
	if _, paused := a.data["paused"]; a.code != "" || paused || a.data["status"] != string(schemas.JobWaitingApproval) {
		t.Fatalf("resume: %q %s", a.code, a.raw)
	}
	if a = call("waymark.api.job.resume", `{"job": "svc-gate", "by": "ops"}`); a.code != "409" || a.errCode() != "conflict" {
		t.Errorf("resume of a job not paused: %q %s, want 409 conflict", a.code, a.raw)
	}

	if a = call("waymark.api.job.approve", `{"job": "svc-gate", "gate": "ok", "by": "bob"}`); a.code != "403" || a.errCode() != "forbidden" || !strings.Contains(a.desc, "alice") {
		t.Errorf("approve by bob: %q %q %s, want 403 forbidden", a.code, a.desc, a.raw)
	}
	if a = call("waymark.api.job.approve", `{"job": "svc-gate", "gate": "nope", "by": "alice"}`); a.code != "404" || a.errCode() != "not_found" {
		t.Errorf("approve of gate nope: %q %s, want 404 not_found", a.code, a.raw)
	}
	a = call("waymark.api.job.approve", `{"job": "svc-gate", "gate": "ok", "by": "alice", "reason": "fine"}`)
	gates, _ := a.data["approvals"].([]any)
	if a.code != "" || len(gates) != 1 || gates[0].(map[string]any)["status"] != "approved" || gates[0].(map[string]any)["decided_by"] != "alice" {
		t.Fatalf("approve by alice: %q %s", a.code, a.raw)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		a = call("waymark.api.job.get", `{"job": "svc-gate"}`)
		return a.data["status"] == string(schemas.JobCompleted)
	}, "job never completed: %s", a.raw)
	if a = call("waymark.api.job.approve", `{"job": "svc-gate", "gate": "ok", "by": "alice"}`); a.code != "409" || a.errCode() != "conflict" || !strings.Contains(a.desc, "already decided") {
		t.Errorf("approve again: %q %q %s, want 409 already decided", a.code, a.desc, a.raw)
	}
	a = call("waymark.api.job.cancel", `{"job": "svc-gate", "by": "ops"}`)
	if job, _ := a.data["job"].(map[string]any); a.code != "409" || a.errCode() != "conflict" || job["status"] != string(schemas.JobCompleted) {
		t.Errorf("cancel of a completed job: %q %s, want 409 with the record", a.code, a.raw)
	}
	if a = call("waymark.api.job.retry", `{"job": "svc-gate", "by": "ops"}`); a.code != "409" {
		t.Errorf("retry of a completed job: %q %s, want 409", a.code, a.raw)
	}
}
