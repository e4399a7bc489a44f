package demo

import (
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"time"
)

const outboxFile = "outbox.jsonl"

// Message is one sent message: one line of DIR/outbox.jsonl.
type Message struct {
	ID      string    `json:"id"` // "msg_000001", ... in order, across restarts
	To      string    `json:"to"`
	Subject string    `json:"subject"`
	Body    string    `json:"body"`
	Key     string    `json:"key"`     // the key it counted under (see Stats)
	SentAt  time.Time `json:"sent_at"` // UTC
}

// SendResponse is the answer to POST /v1/send.
type SendResponse struct {
	ID string `json:"id"`
}

// Outbox is the answer to GET /v1/outbox.
type Outbox struct {
	Messages []Message `json:"messages"`
}

// NewMail opens the mail service, an unsafe effect: it has no idempotency
// at all. Routes:
//
//	POST /v1/send    send; answers 201 SendResponse
//	GET  /v1/outbox  Outbox, in order
//
// The POST body is {"to": "...", "subject": "...", "body": "..."}; to and
// subject are required non-empty strings, body is optional. Every call
// that passes validation sends: two calls, two messages, whatever headers
// they carry. An Idempotency-Key (else an X-Waymark-Effect-Key) is only
// recorded, as the key the call and the send count under.
func NewMail(opts Options) (*Service, error) { return New(NameMail, opts) }

type mail struct {
	s    *Service
	data *journal
	list []Message
}

func messageID(i int) string { return fmt.Sprintf("msg_%06d", i+1) }

func (m *mail) open(s *Service, dir string) error {
	m.s = s
	path := filepath.Join(dir, outboxFile)
	j, err := replayJournal(s, path, func(_ line, msg Message) error {
		if want := messageID(len(m.list)); msg.ID != want {
			return fmt.Errorf("message id %q; want %q", msg.ID, want)
		}
		m.list = append(m.list, msg)
		s.effectN[msg.Key]++
		return nil
	})
	m.data = j
	return err
}

// mailKey is the key a mail call counts under: its Idempotency-Key, else
// its X-Waymark-Effect-Key, else "-". A value that is not a valid key
// counts as absent.
func mailKey(r *http.Request) string {
	for _, h := range []string{IdempotencyKeyHeader, EffectKeyHeader} {
		if k := unquote(strings.TrimSpace(r.Header.Get(h))); checkKey(h, k) == nil {
			return k
		}
	}
	return noKey
}

func (m *mail) effectKey(r *http.Request) (string, bool) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/send" {
		return "", false
	}
	return mailKey(r), true
}

func (m *mail) serve(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/v1/send":
		if r.Method != http.MethodPost {
			methodNotAllowed(w, "POST")
			return
		}
		m.send(w, r)
	case "/v1/outbox":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET, HEAD")
			return
		}
		m.s.mu.Lock()
		out := Outbox{Messages: append([]Message{}, m.list...)}
		m.s.mu.Unlock()
		writeJSON(w, http.StatusOK, out)
	default:
		notFound(w, r)
	}
}

type sendRequest struct {
	To      *string `json:"to"`
	Subject *string `json:"subject"`
	Body    *string `json:"body"`
}

func (m *mail) send(w http.ResponseWriter, r *http.Request) {
	data, herr := readBody(w, r)
	if herr != nil {
		writeError(w, herr)
		return
	}
	var req sendRequest
	if herr := decodeObject(data, &req); herr != nil {
		writeError(w, herr)
		return
	}
	switch {
	case req.To == nil || strings.TrimSpace(*req.To) == "":
		writeError(w, badRequest("field \"to\" is required: a non-empty string"))
		return
	case req.Subject == nil || strings.TrimSpace(*req.Subject) == "":
		writeError(w, badRequest("field \"subject\" is required: a non-empty string"))
		return
	}
	var body string
	if req.Body != nil {
		body = *req.Body
	}
	key := mailKey(r)
	m.s.run(w, r, effect{
		key: key,
		commit: func() (outcome, error) {
			msg := Message{
				ID: messageID(len(m.list)), To: *req.To, Subject: *req.Subject, Body: body,
				Key: key, SentAt: m.s.opts.Now().UTC(),
			}
			if err := m.data.append(msg); err != nil {
				return outcome{}, err
			}
			m.list = append(m.list, msg)
			b, _ := marshal(SendResponse{ID: msg.ID})
			return outcome{status: http.StatusCreated, body: b, performed: true}, nil
		},
	})
}

func (m *mail) close() error { return m.data.close() }
