package demo

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRestart closes each service and opens it again on the same directory,
// as a restarted host would: counters, numbering and replays continue.
func TestRestart(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		retryStatus int // the same logical action after the restart
		wantEffects int
	}{
		{NameTickets, http.StatusOK, 1},
		{NamePayments, http.StatusOK, 1},
		{NameRecords, http.StatusOK, 1},
		{NameMail, http.StatusCreated, 2}, // unsafe: a retry sends again
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tt.name, Options{})
			req := effectRequests[tt.name]
			first, err := req.send(b, "k1")
			if err != nil {
				t.Fatal(err)
			}
			first.want(t, http.StatusCreated)
			before := b.stats()

			b.restart()

			if after := b.stats(); fmt.Sprint(after) != fmt.Sprint(before) {
				t.Fatalf("stats after restart = %+v, want %+v", after, before)
			}
			again, err := req.send(b, "k1")
			if err != nil {
				t.Fatal(err)
			}
			again.want(t, tt.retryStatus)
			if tt.retryStatus == http.StatusOK && !bytes.Equal(again.body, first.body) {
				t.Errorf("after restart: %s, want the first answer %s", again.body, first.body)
			}
			b.wantCounts("k1", 2, tt.wantEffects)

			next, err := req.send(b, "k2")
			if err != nil {
				t.Fatal(err)
			}
			next.want(t, http.StatusCreated)
			want := secondID[tt.name]
			if tt.name == NameMail {
				want = "msg_000003"
			}
			if !bytes.Contains(next.body, []byte(`"id":"`+want+`"`)) {
				t.Errorf("next effect after restart: %s, want id %s", next.body, want)
			}
		})
	}
}

func TestRestartKeepsTicketReplay(t *testing.T) {
	t.Parallel()
	b := setup(t, NameTickets, Options{})
	body := `{"tickets": [{"report_id": "a"}, {"report_id": "b"}]}`
	first := b.must("POST", "/v1/tickets/batch", body, IdempotencyKeyHeader, "k").want(t, http.StatusCreated)
	b.restart() // on another port: the stored URLs still name the first one
	again := b.must("POST", "/v1/tickets/batch", body, IdempotencyKeyHeader, "k").want(t, http.StatusOK)
	if !bytes.Equal(first.body, again.body) || again.header.Get(ReplayedHeader) != "true" {
		t.Errorf("replay after restart: %s %v, want %s", again.body, again.header, first.body)
	}
	b.must("POST", "/v1/tickets/batch", `{"tickets": [{"report_id": "c"}]}`, IdempotencyKeyHeader, "k").
		wantError(t, http.StatusUnprocessableEntity, CodeIdempotencyKeyReused, "different request body")
	next := decode[TicketBatchResponse](t, b.must("POST", "/v1/tickets/batch", body, IdempotencyKeyHeader, "k2").want(t, http.StatusCreated).body)
	if next.Tickets[0].ID != "WM-1003" || next.Tickets[1].ID != "WM-1004" {
		t.Errorf("numbering after restart: %+v, want WM-1003, WM-1004", next.Tickets)
	}
}

// TestTornTail: a write the machine did not finish (never acknowledged) is
// cut off at open; the next effect takes its place.
func TestTornTail(t *testing.T) {
	t.Parallel()
	for _, name := range Names() {
		if name == NameVendors {
			continue // a fixed catalog: no data file
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, name, Options{})
			req := effectRequests[name]
			if r, err := req.send(b, "k1"); err != nil || r.status != http.StatusCreated {
				t.Fatalf("first: %v %+v", err, r)
			}
			if err := b.run.Close(); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(b.opts.Dir, dataFile[name])
			appendFile(t, path, `{"id":"`+secondID[name]+`","ke`)
			appendFile(t, filepath.Join(b.opts.Dir, callsFile), `{"key":"k2"`)

			b.start()
			b.wantCounts("k1", 1, 1)
			if s := b.stats(); s.Calls["k2"] != 0 || s.Effects["k2"] != 0 {
				t.Errorf("torn lines counted: %+v", s)
			}
			r, err := req.send(b, "k2")
			if err != nil {
				t.Fatal(err)
			}
			r.want(t, http.StatusCreated)
			if !bytes.Contains(r.body, []byte(secondID[name])) {
				t.Errorf("after a torn tail: %s, want id %s", r.body, secondID[name])
			}
		})
	}
}

// TestTornTicketBatch: a batch is one write; the part of one at the end of
// the file was never acknowledged and is cut off whole.
func TestTornTicketBatch(t *testing.T) {
	t.Parallel()
	b := setup(t, NameTickets, Options{})
	two := `{"tickets": [{"title": "a"}, {"title": "b"}]}`
	b.must("POST", "/v1/tickets/batch", two, IdempotencyKeyHeader, "k1").want(t, http.StatusCreated)
	b.must("POST", "/v1/tickets/batch", two, IdempotencyKeyHeader, "k2").want(t, http.StatusCreated)
	if err := b.run.Close(); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(b.opts.Dir, ticketsFile)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ls := lines(t, data)
	if err := os.WriteFile(path, append(bytes.Join(ls[:3], []byte("\n")), '\n'), 0o644); err != nil {
		t.Fatal(err)
	}

	b.start()
	s := b.stats()
	if s.Effects["k1"] != 1 || s.Effects["k2"] != 0 {
		t.Fatalf("effects = %v, want k1 once and no k2", s.Effects)
	}
	got := decode[TicketBatchResponse](t, b.must("POST", "/v1/tickets/batch", two, IdempotencyKeyHeader, "k2").want(t, http.StatusCreated).body)
	if got.Tickets[0].ID != "WM-1003" {
		t.Errorf("refiled batch = %+v, want WM-1003 first", got.Tickets)
	}
}

func TestCorruptDataFile(t *testing.T) {
	t.Parallel()
	for _, name := range Names() {
		if name == NameVendors {
			continue // a fixed catalog: no data file
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, dataFile[name]), []byte("{\"id\":\"nope\"}\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := New(name, Options{Dir: dir})
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), dataFile[name]+" line 1") {
				t.Fatalf("New = %v, want ErrCorrupt naming %s line 1", err, dataFile[name])
			}
		})
	}
	t.Run("calls", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, callsFile), []byte("[]\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := New(NameMail, Options{Dir: dir}); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("New = %v, want ErrCorrupt", err)
		}
	})
}

var dataFile = map[string]string{NameTickets: ticketsFile, NamePayments: chargesFile, NameRecords: recordsFile, NameMail: outboxFile}

func appendFile(t *testing.T, path, s string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(s); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}
