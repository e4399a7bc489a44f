package schemas

import (
	"bytes"
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func sampleCheckpoint() *Checkpoint {
	t0 := time.Date(2026, 11, 29, 8, 0, 0, 123456789, time.UTC)
	nb := t0.Add(time.Second)
	done := t0.Add(time.Minute)
	return &Checkpoint{
		Schema: CheckpointSchema, JobID: "job-1", Workflow: "w", Version: 3, DefinitionHash: strings.Repeat("ab", 32),
		Seq: 7, IndexRev: 41, ActiveRev: 44, Reused: true, Status: JobRunning, InputDigest: "d1",
		State: json.RawMessage(`{"a":[1,2,{"b":"c\u00e9\n"}],"z":null}`),
		Vars:  map[string]string{"region": "eu", "quote": "say \"hi\"\t<ok>", "bad": "\xff\x00\u2028"},
		Steps: map[string]*StepRecord{
			"b": {Status: StepDispatched, Attempts: 2, Runs: 1, RunAttempt: 2, LastError: &Error{Code: CodeProvider, Message: "503", Retryable: true}},
			"a": {Status: StepCompleted, Attempts: 1, Runs: 1, ResultDigest: "ff", DurationMs: 12, CompletedSeq: 3},
		},
		Completed: "0,2-5",
		Current: &Dispatch{Step: "b", Attempt: 2, RunAttempt: 2, MsgID: "job-1/b/2", Pool: "default", DispatchedAt: t0, NotBefore: &nb, EffectKey: "w/b/k-1", Due: &nb, Held: true, Gate: "b/1", Wait: "paid",
			Slot: "c.w-b.k.0", Waiting: &FlowWait{Kind: FlowRate, Limit: "w-b", Key: "acme", Max: 2, InUse: 2, Priority: 5, Since: t0, Until: &done, Offer: "c.w-b.k.1"}},
		Approvals: []*Approval{{ID: "b/1", Gate: "b", Run: 1, Digest: "dd", Action: "charge <40> EUR", Data: json.RawMessage(`{"n":1}`), Approvers: []string{"alice"},
			Status: ApprovalApproved, RequestedAt: t0, ExpiresAt: &done, DecidedBy: "alice", DecidedAt: &done, Reason: "ok"}},
		Paused:      &Pause{By: "ops", Reason: "r", At: t0},
		Retries:     2,
		LastControl: &ControlRecord{ID: "c1", Type: "pause", By: "ops", At: t0},
		LastSignal:  &ReceivedSignal{ID: "s2", Name: "paid", At: t0, Outcome: "dropped"},
		ValidUntil:  map[string]time.Time{"a": t0, "b": done},
		Refresh:     &Refresh{Step: "a", Then: "b"},
		DeadlineAt:  &done,
		Signals:     []*ReceivedSignal{{ID: "s1", Name: "paid", Data: json.RawMessage(`{"n":1}`), By: "ops", At: t0, Taken: "b"}},
		Cause:       "job-1/b/1/result",
		Flushed:     5,
		Flush:       true,
		Blocked: &Blocked{Step: "b", EffectKey: "job-1/b", Class: EffectUnsafe, Reason: "unknown",
			LastError: &Error{Code: CodeTimeout, Message: "slow"}},
		BlockedReason: "definition x not found", BlockedFrom: JobRunning,
		EffectKeys: []string{"w/b/k-1", "w/c/k-2"},
		Events: []Event{
			{Type: EventStepFailed, Time: t0, Data: HistoryData{Job: "job-1", Seq: 7, Step: "b", Attempt: 1, Error: &Error{Code: CodeTimeout, Message: "slow", Job: "job-1", Step: "b", Attempt: 1, Retryable: true}, Retrying: true, NotBefore: nb}},
			{Type: EventJobStarted, Time: t0, Data: HistoryData{Job: "job-1", Seq: 1, Status: "running", Input: json.RawMessage(`{"x":1}`), Reason: "r", Next: "n", NextAttempt: 2, ResultDigest: "d", DurationMs: 5,
				EffectKey: "k", EffectState: "confirmed", ExternalID: "ch_1", By: "ops", Approval: &Approval{ID: "b/1", Gate: "b", Status: ApprovalPending, RequestedAt: t0},
				Signal: &ReceivedSignal{ID: "s1", Name: "paid", At: t0}, State: json.RawMessage(`{"set":{"a":1},"unset":["b"]}`), ToSeq: 3, Runs: map[string]int{"b": 1, "a": 2},
				Flow: &FlowWait{Kind: FlowConcurrency, Limit: "w-b", Max: 1, InUse: 1, Since: t0}}},
		},
		ResumeCount: 2, ResumedBy: "inc", Writer: "w1", Error: &Error{Code: CodeStepFailed, Message: "m"},
		Parent: "p", Fork: &ForkOrigin{Parent: "p", Seq: 3, From: "b", Runs: map[string]int{"a": 1}, ParentRuns: map[string]int{"a": 1, "b": 1}, KeyBase: "p"},
		CreatedAt: t0, UpdatedAt: t0.Add(time.Hour), CompletedAt: &done,
	}
}

func TestAppendJSONMatchesEncodingJSON(t *testing.T) {
	t.Parallel()
	for name, cp := range map[string]*Checkpoint{
		"full":    sampleCheckpoint(),
		"minimal": {Schema: 1, JobID: "j", Seq: 1, Status: JobCompleted, State: json.RawMessage(`{}`)},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			got := cp.AppendJSON(nil)
			if !json.Valid(got) {
				t.Fatalf("not valid JSON: %s", got)
			}
			var viaOurs, viaStd Checkpoint
			if err := json.Unmarshal(got, &viaOurs); err != nil {
				t.Fatal(err)
			}
			// Outbox events are stored without their job, the checkpoint's own.
			want := *cp
			want.Events = slices.Clone(cp.Events)
			for i := range want.Events {
				want.Events[i].Data.Job = ""
			}
			std, err := json.Marshal(&want)
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(std, &viaStd); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(viaOurs, viaStd) {
				t.Fatalf("decoded values differ\nours: %s\nstd:  %s", got, std)
			}
			// Byte for byte too, once encoding/json's HTML escaping is undone.
			std = []byte(strings.NewReplacer(`\u003c`, "<", `\u003e`, ">", `\u0026`, "&").Replace(string(std)))
			if !bytes.Equal(got, std) {
				t.Errorf("encodings differ\nours: %s\nstd:  %s", got, std)
			}
		})
	}
}

func TestStepMessageAppendJSON(t *testing.T) {
	t.Parallel()
	nb := time.Date(2026, 1, 2, 3, 4, 5, 6, time.FixedZone("x", 3600))
	m := &StepMessage{Job: "j", Step: "s", Attempt: 3, RunAttempt: 1, DefinitionHash: "h", State: json.RawMessage(`{"k":"v"}`),
		Vars: map[string]string{"a": "b"}, NotBefore: &nb, IdempotencyKey: "j/s", EffectKey: "w/s/k-1"}
	got := m.AppendJSON(nil)
	std, _ := json.Marshal(m)
	if !bytes.Equal(got, std) {
		t.Fatalf("ours %s\nstd  %s", got, std)
	}
}

func FuzzAppendString(f *testing.F) {
	for _, s := range []string{"", "plain", "quote\"back\\slash", "\x00\x1f\x7f", "é\u2028\u2029", "\xff\xfe", "<&>"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		w := jsonw{}
		w.str(s)
		var got string
		if err := json.Unmarshal(w.b, &got); err != nil {
			t.Fatalf("%q encodes to invalid JSON %s: %v", s, w.b, err)
		}
		std, _ := json.Marshal(s)
		var want string
		_ = json.Unmarshal(std, &want)
		if got != want {
			t.Fatalf("%q: decodes to %q, encoding/json's to %q", s, got, want)
		}
	})
}

func BenchmarkCheckpointEncode(b *testing.B) {
	cp := sampleCheckpoint()
	cp.State = json.RawMessage(`{"payload":"` + strings.Repeat("x", 1024) + `"}`)
	b.Run("append", func(b *testing.B) {
		b.ReportAllocs()
		buf := make([]byte, 0, 4096)
		for b.Loop() {
			buf = cp.AppendJSON(buf[:0])
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = json.Marshal(cp)
		}
	})
}

func BenchmarkCheckpointDecode(b *testing.B) {
	cp := sampleCheckpoint()
	cp.State = json.RawMessage(`{"payload":"` + strings.Repeat("x", 1024) + `"}`)
	data := cp.AppendJSON(nil)
	b.ReportAllocs()
	for b.Loop() {
		var c Checkpoint
		if err := json.Unmarshal(data, &c); err != nil {
			b.Fatal(err)
		}
	}
}

// TestHistoryBatchIDsMatchTheOutbox: an event published in a batch that
// holds several transitions has the id CheckpointHistory gives it from
// the outbox, so a reader of both (client.Wait) sees each event once and
// none is taken for another.
func TestHistoryBatchIDsMatchTheOutbox(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	evs := []Event{
		{Type: EventStepCompleted, Time: at, Data: HistoryData{Job: "j", Seq: 3, Step: "a"}},
		{Type: EventStepDispatched, Time: at, Data: HistoryData{Job: "j", Seq: 3, Step: "b"}},
		{Type: EventStepCompleted, Time: at, Data: HistoryData{Job: "j", Seq: 4, Step: "b"}},
		{Type: EventJobCompleted, Time: at, Data: HistoryData{Job: "j", Seq: 4}},
	}
	got, err := DecodeHistory(AppendHistoryBatch(nil, HistorySourceEngine, "j", 4, evs))
	if err != nil {
		t.Fatal(err)
	}
	want := CheckpointHistory("j", evs)
	if len(got) != len(want) {
		t.Fatalf("%d events, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].ID != want[i].ID || got[i].Type != want[i].Type {
			t.Errorf("event %d: %s %s, want %s %s", i, got[i].ID, got[i].Type, want[i].ID, want[i].Type)
		}
	}
	if want[2].ID != "j/4/0" || want[1].ID != "j/3/1" {
		t.Errorf("ids %s, %s: want j/3/1 and j/4/0", want[1].ID, want[2].ID)
	}
}
