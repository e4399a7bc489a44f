package demo

import (
	"net/http"
	"os"
	"path/filepath"
	"testing"
)

func TestRecordsLookup(t *testing.T) {
	t.Parallel()
	b := setup(t, NameRecords, Options{})
	const key = "job-1/notify"
	// Escaped and unescaped paths name the same record.
	const escaped, plain = "/v1/records/job-1%2Fnotify", "/v1/records/job-1/notify"

	b.must("GET", escaped, "").wantError(t, http.StatusNotFound, CodeNotFound, `"job-1/notify"`)

	created := b.must("PUT", escaped, `{"status": "sent", "count": 2}`).want(t, http.StatusCreated)
	rec := decode[Record](t, created.body)
	if rec.Key != key || rec.ID != "rec_000001" || string(rec.Body) != `{"count":2,"status":"sent"}` || rec.CreatedAt.IsZero() {
		t.Fatalf("PUT answer = %+v", rec)
	}
	for _, p := range []string{escaped, plain} {
		got := b.must("GET", p, "").want(t, http.StatusOK)
		if string(got.body) != string(created.body) {
			t.Errorf("GET %s = %s, want %s", p, got.body, created.body)
		}
	}

	same := b.must("PUT", plain, `{ "count": 2, "status": "sent" }`).want(t, http.StatusOK)
	if string(same.body) != string(created.body) {
		t.Errorf("same-body PUT = %s, want the existing record %s", same.body, created.body)
	}
	b.must("PUT", plain, `{"status": "failed"}`).wantError(t, http.StatusConflict, CodeRecordConflict, "rec_000001")
	if got := b.must("GET", plain, "").want(t, http.StatusOK); string(got.body) != string(created.body) {
		t.Errorf("after a conflicting PUT: %s, want unchanged %s", got.body, created.body)
	}
	b.wantCounts(key, 3, 1)

	list := decode[RecordList](t, b.must("GET", "/v1/records", "").want(t, http.StatusOK).body)
	if len(list.Records) != 1 {
		t.Errorf("GET /v1/records = %+v", list)
	}
	b.must("DELETE", plain, "").wantError(t, http.StatusMethodNotAllowed, CodeMethodNotAllowed, "PUT")
}

func TestMailSendsEveryCall(t *testing.T) {
	t.Parallel()
	b := setup(t, NameMail, Options{})
	const body = `{"to": "ops@example.com", "subject": "Report ready"}`
	for i, want := range []string{"msg_000001", "msg_000002"} {
		got := decode[SendResponse](t, b.must("POST", "/v1/send", body, IdempotencyKeyHeader, "job-1/notify").want(t, http.StatusCreated).body)
		if got.ID != want {
			t.Errorf("send %d: id %s, want %s", i+1, got.ID, want)
		}
	}
	b.must("POST", "/v1/send", body, EffectKeyHeader, "job-2/notify").want(t, http.StatusCreated)
	b.must("POST", "/v1/send", body).want(t, http.StatusCreated)

	b.wantCounts("job-1/notify", 2, 2)
	b.wantCounts("job-2/notify", 1, 1)
	b.wantCounts(noKey, 1, 1)

	out := decode[Outbox](t, b.must("GET", "/v1/outbox", "").want(t, http.StatusOK).body)
	if len(out.Messages) != 4 || out.Messages[1].Key != "job-1/notify" || out.Messages[3].ID != "msg_000004" {
		t.Errorf("outbox = %+v", out)
	}
	data, err := os.ReadFile(filepath.Join(b.opts.Dir, outboxFile))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(lines(t, data)); n != 4 {
		t.Errorf("outbox.jsonl has %d lines, want 4", n)
	}
}
