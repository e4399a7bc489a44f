package demo

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

func TestIdempotentReplay(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		service string
		path    string
		body    string
		// same is body with other white space and key order: the same
		// request once canonicalised.
		same    string
		wantIDs []string
		file    string
		// key2 is sent the second time; the draft's quoted form of the
		// same key must be the same key.
		key2 string
	}{
		{
			name:    "tickets",
			service: NameTickets,
			path:    "/v1/tickets/batch",
			body:    `{"tickets": [{"report_id": "r-1", "title": "Disk full", "severity": "high", "component": "db", "summary": "95%"}, {"report_id": "r-2", "title": "Slow <query>"}]}`,
			same:    "{\"tickets\":[{\"title\":\"Disk full\",\"summary\":\"95%\",\"severity\":\"high\",\"report_id\":\"r-1\",\"component\":\"db\"},\n {\"title\":\"Slow <query>\",\"report_id\":\"r-2\"}]}",
			wantIDs: []string{"WM-1001", "WM-1002"},
			file:    ticketsFile,
			key2:    "job-1/file-tickets",
		},
		{
			name:    "payments",
			service: NamePayments,
			path:    "/v1/charges",
			body:    `{"amount_cents": 1250, "currency": "eur", "order_id": "o-7"}`,
			same:    `{ "order_id": "o-7", "currency": "eur", "amount_cents": 1250 }`,
			wantIDs: []string{"ch_000001"},
			file:    chargesFile,
			key2:    "job-1/file-tickets",
		},
		{
			name:    "quoted key",
			service: NamePayments,
			path:    "/v1/charges",
			body:    `{"amount_cents": 1, "currency": "usd", "order_id": "o-8"}`,
			same:    `{"amount_cents": 1, "currency": "usd", "order_id": "o-8"}`,
			wantIDs: []string{"ch_000001"},
			file:    chargesFile,
			key2:    `"job-1/file-tickets"`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tt.service, Options{})
			const key = "job-1/file-tickets"
			first := b.must("POST", tt.path, tt.body, IdempotencyKeyHeader, key).want(t, http.StatusCreated)
			if got := first.header.Get(ReplayedHeader); got != "" {
				t.Errorf("first answer has %s: %q", ReplayedHeader, got)
			}
			second := b.must("POST", tt.path, tt.same, IdempotencyKeyHeader, tt.key2).want(t, http.StatusOK)
			if got := second.header.Get(ReplayedHeader); got != "true" {
				t.Errorf("second answer %s = %q, want true", ReplayedHeader, got)
			}
			if !bytes.Equal(first.body, second.body) {
				t.Errorf("replayed body differs:\nfirst  %s\nsecond %s", first.body, second.body)
			}
			for _, id := range tt.wantIDs {
				if !bytes.Contains(first.body, []byte(`"id":"`+id+`"`)) {
					t.Errorf("answer %s lacks id %s", first.body, id)
				}
			}
			b.wantCounts(key, 2, 1)
			data, err := os.ReadFile(filepath.Join(b.opts.Dir, tt.file))
			if err != nil {
				t.Fatal(err)
			}
			if got := len(lines(t, data)); got != len(tt.wantIDs) {
				t.Errorf("%s has %d lines, want %d:\n%s", tt.file, got, len(tt.wantIDs), data)
			}
		})
	}
}

func TestTicketsAnswerAndFile(t *testing.T) {
	t.Parallel()
	b := setup(t, NameTickets, Options{})
	body := `{"tickets": [{"report_id": "r-1", "title": "Disk full", "severity": "high", "component": "db", "summary": "95%"}, {"title": "no report"}]}`
	got := decode[TicketBatchResponse](t, b.must("POST", "/v1/tickets/batch", body, IdempotencyKeyHeader, "k").want(t, http.StatusCreated).body)
	want := []TicketRef{
		{ID: "WM-1001", ReportID: "r-1", URL: b.run.URL + "/v1/tickets/WM-1001"},
		{ID: "WM-1002", ReportID: "", URL: b.run.URL + "/v1/tickets/WM-1002"},
	}
	if fmt.Sprint(got.Tickets) != fmt.Sprint(want) {
		t.Fatalf("tickets = %+v, want %+v", got.Tickets, want)
	}

	tk := decode[Ticket](t, b.must("GET", "/v1/tickets/WM-1001", "").want(t, http.StatusOK).body)
	if tk.ReportID != "r-1" || tk.IdempotencyKey != "k" || tk.Batch != 1 || tk.BatchSize != 2 ||
		string(tk.Item) != `{"component":"db","report_id":"r-1","severity":"high","summary":"95%","title":"Disk full"}` {
		t.Errorf("GET WM-1001 = %+v", tk)
	}
	b.must("GET", "/v1/tickets/WM-1003", "").wantError(t, http.StatusNotFound, CodeNotFound, "WM-1003")

	list := decode[TicketList](t, b.must("GET", "/v1/tickets", "").want(t, http.StatusOK).body)
	if len(list.Tickets) != 2 || list.Tickets[1].ID != "WM-1002" {
		t.Errorf("GET /v1/tickets = %+v", list)
	}

	// The file a user opens: one ticket a line, in order.
	data, err := os.ReadFile(filepath.Join(b.opts.Dir, ticketsFile))
	if err != nil {
		t.Fatal(err)
	}
	ls := lines(t, data)
	if len(ls) != 2 {
		t.Fatalf("tickets.jsonl has %d lines:\n%s", len(ls), data)
	}
	for i, l := range ls {
		if tk := decode[Ticket](t, l); tk.ID != want[i].ID {
			t.Errorf("line %d is ticket %s, want %s", i+1, tk.ID, want[i].ID)
		}
	}
}

func TestKeyReusedWithOtherBody(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, service, path, body, other string
	}{
		{"tickets", NameTickets, "/v1/tickets/batch", `{"tickets": [{"title": "a"}]}`, `{"tickets": [{"title": "b"}]}`},
		{"payments", NamePayments, "/v1/charges", `{"amount_cents": 100, "currency": "usd", "order_id": "o"}`, `{"amount_cents": 101, "currency": "usd", "order_id": "o"}`},
		// Numbers compare as written: 1 and 1.0 are different requests.
		{"number literal", NameTickets, "/v1/tickets/batch", `{"tickets": [{"n": 1}]}`, `{"tickets": [{"n": 1.0}]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tt.service, Options{})
			first := b.must("POST", tt.path, tt.body, IdempotencyKeyHeader, "k").want(t, http.StatusCreated)
			b.must("POST", tt.path, tt.other, IdempotencyKeyHeader, "k").wantError(t, http.StatusUnprocessableEntity, CodeIdempotencyKeyReused, `"k"`)
			// The key still replays its first request.
			again := b.must("POST", tt.path, tt.body, IdempotencyKeyHeader, "k").want(t, http.StatusOK)
			if !bytes.Equal(again.body, first.body) {
				t.Errorf("replay after 422 = %s, want %s", again.body, first.body)
			}
			b.wantCounts("k", 3, 1)
		})
	}
}

// TestKeyInUse holds a first request inside the BeforeCommit hook, so the
// second request with its key deterministically meets it in flight.
func TestKeyInUse(t *testing.T) {
	t.Parallel()
	for _, name := range []string{NameTickets, NamePayments, NameRecords} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			entered := make(chan struct{})
			release := make(chan struct{})
			var releaseOnce sync.Once
			unblock := func() { releaseOnce.Do(func() { close(release) }) }
			t.Cleanup(unblock) // a failed test must not leave the handler parked
			b := setup(t, name, Options{BeforeCommit: func(key string) {
				if key == "held" {
					entered <- struct{}{}
					<-release
				}
			}})
			req := effectRequests[name]

			type result struct {
				r   response
				err error
			}
			firstDone := make(chan result, 1)
			go func() {
				r, err := req.send(b, "held")
				firstDone <- result{r, err}
			}()
			<-entered

			second, err := req.send(b, "held")
			if err != nil {
				t.Fatal(err)
			}
			second.wantError(t, http.StatusConflict, CodeIdempotencyKeyInUse, `"held"`)
			// Other keys are not held up.
			other, err := req.send(b, "other")
			if err != nil {
				t.Fatal(err)
			}
			other.want(t, http.StatusCreated)

			unblock()
			first := <-firstDone
			if first.err != nil {
				t.Fatal(first.err)
			}
			first.r.want(t, http.StatusCreated)
			third, err := req.send(b, "held")
			if err != nil {
				t.Fatal(err)
			}
			third.want(t, http.StatusOK)
			if !bytes.Equal(third.body, first.r.body) {
				t.Errorf("after the first finished: %s, want %s", third.body, first.r.body)
			}
			b.wantCounts("held", 3, 1)
		})
	}
}

func TestConcurrentDistinctKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, NameTickets, Options{})
	const n = 40
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			r, err := b.send("POST", "/v1/tickets/batch", `{"tickets": [{"title": "t"}]}`, IdempotencyKeyHeader, fmt.Sprintf("k-%d", i))
			if err == nil && r.status != http.StatusCreated {
				err = fmt.Errorf("key k-%d: status %d: %s", i, r.status, r.body)
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	list := decode[TicketList](t, b.must("GET", "/v1/tickets", "").want(t, http.StatusOK).body)
	seen := map[string]bool{}
	for _, tk := range list.Tickets {
		seen[tk.ID] = true
	}
	for i := range n {
		if id := ticketID(i); !seen[id] {
			t.Errorf("ticket %s missing; have %d tickets", id, len(list.Tickets))
		}
	}
	s := b.stats()
	for i := range n {
		if k := fmt.Sprintf("k-%d", i); s.Effects[k] != 1 || s.Calls[k] != 1 {
			t.Errorf("key %s: calls %d effects %d, want 1 and 1", k, s.Calls[k], s.Effects[k])
		}
	}
	if strings.Count(fmt.Sprint(s.Effects), ":") != n {
		t.Errorf("effects = %v, want %d keys", s.Effects, n)
	}
}
