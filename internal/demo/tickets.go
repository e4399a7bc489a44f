package demo

import (
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"time"
)

// Tickets' limits and numbering.
const (
	// MaxTicketsPerBatch is the most tickets one POST /v1/tickets/batch may
	// file.
	MaxTicketsPerBatch = 100
	// FirstTicketNumber is the number of the first ticket: ids run
	// "WM-1001", "WM-1002", ... in filing order, across restarts.
	FirstTicketNumber = 1001
)

const ticketsFile = "tickets.jsonl"

// Ticket is one filed ticket: one line of DIR/tickets.jsonl, and the answer
// to GET /v1/tickets/{id}.
type Ticket struct {
	ID       string          `json:"id"`                  // "WM-1001", ...
	URL      string          `json:"url"`                 // <base>/v1/tickets/<id>
	ReportID string          `json:"report_id,omitempty"` // the item's report_id, if it had one
	Item     json.RawMessage `json:"item"`                // the submitted object, canonical JSON

	IdempotencyKey     string    `json:"idempotency_key"`     // the key of the request that filed it
	RequestFingerprint string    `json:"request_fingerprint"` // "sha256:<hex>" of that request's canonical body
	Batch              int       `json:"batch"`               // 1-based position in that request
	BatchSize          int       `json:"batch_size"`          // how many tickets that request filed
	CreatedAt          time.Time `json:"created_at"`          // UTC
}

// TicketRef is one element of the answer to POST /v1/tickets/batch.
type TicketRef struct {
	ID       string `json:"id"`
	ReportID string `json:"report_id"` // "" when the item had none
	URL      string `json:"url"`
}

// TicketBatchResponse is the answer to POST /v1/tickets/batch: one ref per
// submitted item, in order.
type TicketBatchResponse struct {
	Tickets []TicketRef `json:"tickets"`
}

// TicketList is the answer to GET /v1/tickets.
type TicketList struct {
	Tickets []Ticket `json:"tickets"`
}

// NewTickets opens the tickets service, an idempotent effect. Routes:
//
//	POST /v1/tickets/batch  file tickets; Idempotency-Key required
//	GET  /v1/tickets        TicketList, in filing order
//	GET  /v1/tickets/{id}   Ticket, or 404
//
// The POST body is {"tickets": [object, ...]} with 1 to
// MaxTicketsPerBatch JSON objects of any shape; a "report_id" in an object
// must be a string and is echoed back. Answers: 201 TicketBatchResponse; 200
// with Idempotent-Replayed: true and the first answer's body for a repeat of
// the key with the same canonical body; 422 CodeIdempotencyKeyReused for the
// key with another body; 409 CodeIdempotencyKeyInUse while the key's first
// request runs; 400 for a missing key or bad body. All tickets of a request
// are written to tickets.jsonl in one fsynced write before the answer.
func NewTickets(opts Options) (*Service, error) { return New(NameTickets, opts) }

type tickets struct {
	s       *Service
	data    *journal
	list    []Ticket
	byID    map[string]int
	replays map[string]stored
}

func ticketID(i int) string { return fmt.Sprintf("WM-%d", FirstTicketNumber+i) }

func (t *tickets) open(s *Service, dir string) error {
	t.s, t.byID, t.replays = s, map[string]int{}, map[string]stored{}
	path := filepath.Join(dir, ticketsFile)
	var batch []Ticket
	var batchOff int64
	j, err := replayJournal(s, path, func(l line, tk Ticket) error {
		if want := ticketID(len(t.list) + len(batch)); tk.ID != want {
			return fmt.Errorf("ticket id %q; want %q", tk.ID, want)
		}
		if tk.BatchSize < 1 || tk.Batch < 1 || tk.Batch > tk.BatchSize {
			return fmt.Errorf("ticket %s is %d of %d in its batch", tk.ID, tk.Batch, tk.BatchSize)
		}
		switch {
		case tk.Batch == 1 && len(batch) > 0:
			return fmt.Errorf("the batch of key %q ends after %d of %d tickets", batch[0].IdempotencyKey, len(batch), batch[0].BatchSize)
		case tk.Batch == 1:
			batchOff = l.off
		case len(batch) == 0 || tk.Batch != len(batch)+1 || tk.IdempotencyKey != batch[0].IdempotencyKey || tk.BatchSize != batch[0].BatchSize:
			return fmt.Errorf("ticket %s (%d of %d, key %q) does not continue its batch", tk.ID, tk.Batch, tk.BatchSize, tk.IdempotencyKey)
		}
		batch = append(batch, tk)
		if len(batch) == tk.BatchSize {
			t.add(batch)
			s.effectN[tk.IdempotencyKey]++
			batch = nil
		}
		return nil
	})
	if err != nil {
		return err
	}
	if len(batch) > 0 {
		// A batch is written in one write; a part of one at the end is a
		// write the machine did not finish, never acknowledged.
		if err := j.truncate(batchOff); err != nil {
			_ = j.close()
			return err
		}
		s.repaired(path, fmt.Sprintf("%d of %d tickets of key %q", len(batch), batch[0].BatchSize, batch[0].IdempotencyKey))
	}
	t.data = j
	return nil
}

// add records a committed batch in memory: the list, the replay and the
// effect count. With s.mu held, or during open.
func (t *tickets) add(batch []Ticket) []byte {
	refs := make([]TicketRef, len(batch))
	for i, tk := range batch {
		t.byID[tk.ID] = len(t.list)
		t.list = append(t.list, tk)
		refs[i] = TicketRef{ID: tk.ID, ReportID: tk.ReportID, URL: tk.URL}
	}
	body, _ := marshal(TicketBatchResponse{Tickets: refs}) // plain strings: cannot fail
	key := batch[0].IdempotencyKey
	if _, ok := t.replays[key]; !ok {
		t.replays[key] = stored{fp: batch[0].RequestFingerprint, body: body}
	}
	return body
}

func (t *tickets) effectKey(r *http.Request) (string, bool) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/tickets/batch" {
		return "", false
	}
	if key, err := idempotencyKey(r); err == nil {
		return key, true
	}
	return noKey, true
}

func (t *tickets) serve(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Path
	switch {
	case p == "/v1/tickets/batch":
		if r.Method != http.MethodPost {
			methodNotAllowed(w, "POST")
			return
		}
		t.create(w, r)
	case p == "/v1/tickets":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET, HEAD")
			return
		}
		t.s.mu.Lock()
		list := TicketList{Tickets: append([]Ticket{}, t.list...)}
		t.s.mu.Unlock()
		writeJSON(w, http.StatusOK, list)
	case strings.HasPrefix(p, "/v1/tickets/"):
		serveItem(w, r, t.s, "/v1/tickets/", "ticket", func(id string) (Ticket, bool) {
			i, ok := t.byID[id]
			if !ok {
				return Ticket{}, false
			}
			return t.list[i], true
		})
	default:
		notFound(w, r)
	}
}

type ticketBatchRequest struct {
	Tickets []json.RawMessage `json:"tickets"`
}

func (t *tickets) create(w http.ResponseWriter, r *http.Request) {
	key, herr := idempotencyKey(r)
	if herr != nil {
		writeError(w, herr)
		return
	}
	data, herr := readBody(w, r)
	if herr != nil {
		writeError(w, herr)
		return
	}
	var req ticketBatchRequest
	if herr := decodeObject(data, &req); herr != nil {
		writeError(w, herr)
		return
	}
	switch n := len(req.Tickets); {
	case req.Tickets == nil:
		writeError(w, badRequest("field \"tickets\" is required: an array of 1 to %d objects", MaxTicketsPerBatch))
		return
	case n == 0:
		writeError(w, badRequest("field \"tickets\" is empty; want 1 to %d objects", MaxTicketsPerBatch))
		return
	case n > MaxTicketsPerBatch:
		writeError(w, badRequest("field \"tickets\" has %d items; the limit is %d", n, MaxTicketsPerBatch))
		return
	}
	items := make([]json.RawMessage, len(req.Tickets))
	reportIDs := make([]string, len(req.Tickets))
	for i, raw := range req.Tickets {
		if k := jsonKind(raw); k != "object" {
			writeError(w, badRequest("tickets[%d] is a JSON %s; want an object", i, k))
			return
		}
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(raw, &fields); err != nil {
			writeError(w, badRequest("tickets[%d]: %v", i, err))
			return
		}
		if rid, ok := fields["report_id"]; ok {
			if err := json.Unmarshal(rid, &reportIDs[i]); err != nil || jsonKind(rid) != "string" {
				writeError(w, badRequest("tickets[%d].report_id is a JSON %s; want a string", i, jsonKind(rid)))
				return
			}
		}
		c, err := canonical(raw)
		if err != nil {
			writeError(w, badRequest("tickets[%d]: %v", i, err))
			return
		}
		items[i] = c
	}
	canon, err := canonical(data)
	if err != nil {
		writeError(w, badRequest("malformed JSON: %v", err))
		return
	}
	fp := fingerprint(canon)
	base := t.s.requestBase(r)
	t.s.run(w, r, effect{
		key:       key,
		exclusive: true,
		decided:   replay(t.replays, key, fp),
		commit: func() (outcome, error) {
			now := t.s.opts.Now().UTC()
			batch := make([]Ticket, len(items))
			recs := make([]any, len(items))
			for i := range items {
				id := ticketID(len(t.list) + i)
				batch[i] = Ticket{
					ID: id, URL: base + "/v1/tickets/" + id, ReportID: reportIDs[i], Item: items[i],
					IdempotencyKey: key, RequestFingerprint: fp, Batch: i + 1, BatchSize: len(items), CreatedAt: now,
				}
				recs[i] = batch[i]
			}
			if err := t.data.append(recs...); err != nil {
				return outcome{}, err
			}
			return outcome{status: http.StatusCreated, body: t.add(batch), performed: true}, nil
		},
	})
}

func (t *tickets) close() error { return t.data.close() }
