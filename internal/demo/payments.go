package demo

import (
	"fmt"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

const chargesFile = "charges.jsonl"

// ChargeSucceeded is the status of every charge: the demo never declines.
const ChargeSucceeded = "succeeded"

// Charge is one charge: the answer to POST /v1/charges and to GET
// /v1/charges/{id}.
type Charge struct {
	ID          string    `json:"id"`           // "ch_000001", "ch_000002", ... in order, across restarts
	Status      string    `json:"status"`       // ChargeSucceeded
	AmountCents int64     `json:"amount_cents"` // > 0, in the currency's minor unit
	Currency    string    `json:"currency"`     // ISO 4217, lower case: "usd", "eur", ...
	OrderID     string    `json:"order_id"`
	CreatedAt   time.Time `json:"created_at"` // UTC
}

// ChargeList is the answer to GET /v1/charges.
type ChargeList struct {
	Charges []Charge `json:"charges"`
}

// chargeLine is one line of DIR/charges.jsonl.
type chargeLine struct {
	Charge
	IdempotencyKey     string `json:"idempotency_key"`
	RequestFingerprint string `json:"request_fingerprint"`
}

// NewPayments opens the payments service, an idempotent effect modelled
// on Stripe's charges. Routes:
//
//	POST /v1/charges       charge; Idempotency-Key required
//	GET  /v1/charges       ChargeList, in order
//	GET  /v1/charges/{id}  Charge, or 404
//
// The POST body is {"amount_cents": integer > 0, "currency": "usd",
// "order_id": "..."}, all three required, no other fields. Answers are those
// of NewTickets with a Charge in place of the ticket refs: 201, a 200 replay
// marked Idempotent-Replayed: true, 422, 409, 400.
func NewPayments(opts Options) (*Service, error) { return New(NamePayments, opts) }

type payments struct {
	s       *Service
	data    *journal
	list    []Charge
	byID    map[string]int
	replays map[string]stored
}

func chargeID(i int) string { return fmt.Sprintf("ch_%06d", i+1) }

func (p *payments) open(s *Service, dir string) error {
	p.s, p.byID, p.replays = s, map[string]int{}, map[string]stored{}
	path := filepath.Join(dir, chargesFile)
	j, err := replayJournal(s, path, func(_ line, c chargeLine) error {
		if want := chargeID(len(p.list)); c.ID != want {
			return fmt.Errorf("charge id %q; want %q", c.ID, want)
		}
		p.add(c)
		s.effectN[c.IdempotencyKey]++
		return nil
	})
	p.data = j
	return err
}

// add records a committed charge in memory. With s.mu held, or during open.
func (p *payments) add(c chargeLine) []byte {
	p.byID[c.ID] = len(p.list)
	p.list = append(p.list, c.Charge)
	body, _ := marshal(c.Charge) // plain fields: cannot fail
	if _, ok := p.replays[c.IdempotencyKey]; !ok {
		p.replays[c.IdempotencyKey] = stored{fp: c.RequestFingerprint, body: body}
	}
	return body
}

func (p *payments) effectKey(r *http.Request) (string, bool) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/charges" {
		return "", false
	}
	if key, err := idempotencyKey(r); err == nil {
		return key, true
	}
	return noKey, true
}

func (p *payments) serve(w http.ResponseWriter, r *http.Request) {
	path := r.URL.Path
	switch {
	case path == "/v1/charges" && r.Method == http.MethodPost:
		p.create(w, r)
	case path == "/v1/charges":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET, HEAD, POST")
			return
		}
		p.s.mu.Lock()
		list := ChargeList{Charges: append([]Charge{}, p.list...)}
		p.s.mu.Unlock()
		writeJSON(w, http.StatusOK, list)
	case strings.HasPrefix(path, "/v1/charges/"):
		serveItem(w, r, p.s, "/v1/charges/", "charge", func(id string) (Charge, bool) {
			i, ok := p.byID[id]
			if !ok {
				return Charge{}, false
			}
			return p.list[i], true
		})
	default:
		notFound(w, r)
	}
}

type chargeRequest struct {
	AmountCents *int64  `json:"amount_cents"`
	Currency    *string `json:"currency"`
	OrderID     *string `json:"order_id"`
}

var currencyCode = regexp.MustCompile(`^[a-z]{3}$`)

func (req chargeRequest) validate() *httpError {
	switch {
	case req.AmountCents == nil:
		return badRequest("field \"amount_cents\" is required: an integer > 0")
	case *req.AmountCents <= 0:
		return badRequest("field \"amount_cents\" is %d; want an integer > 0", *req.AmountCents)
	case req.Currency == nil:
		return badRequest("field \"currency\" is required: a three-letter ISO 4217 code in lower case, such as \"usd\"")
	case !currencyCode.MatchString(*req.Currency):
		return badRequest("field \"currency\" is %q; want a three-letter ISO 4217 code in lower case, such as \"usd\"", *req.Currency)
	case req.OrderID == nil || *req.OrderID == "":
		return badRequest("field \"order_id\" is required: a non-empty string")
	}
	return nil
}

func (p *payments) create(w http.ResponseWriter, r *http.Request) {
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
	var req chargeRequest
	if herr := decodeObject(data, &req); herr != nil {
		writeError(w, herr)
		return
	}
	if herr := req.validate(); herr != nil {
		writeError(w, herr)
		return
	}
	canon, err := canonical(data)
	if err != nil {
		writeError(w, badRequest("malformed JSON: %v", err))
		return
	}
	fp := fingerprint(canon)
	p.s.run(w, r, effect{
		key:       key,
		exclusive: true,
		decided:   replay(p.replays, key, fp),
		commit: func() (outcome, error) {
			c := chargeLine{
				Charge: Charge{
					ID: chargeID(len(p.list)), Status: ChargeSucceeded, AmountCents: *req.AmountCents,
					Currency: *req.Currency, OrderID: *req.OrderID, CreatedAt: p.s.opts.Now().UTC(),
				},
				IdempotencyKey: key, RequestFingerprint: fp,
			}
			if err := p.data.append(c); err != nil {
				return outcome{}, err
			}
			return outcome{status: http.StatusCreated, body: p.add(c), performed: true}, nil
		},
	})
}

func (p *payments) close() error { return p.data.close() }
