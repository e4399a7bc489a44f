package demo

import (
	"errors"
	"net/http"
	"strings"
	"testing"
)

func TestBadInput(t *testing.T) {
	t.Parallel()
	const key = IdempotencyKeyHeader
	big := `{"tickets": [{"summary": "` + strings.Repeat("x", MaxBodyBytes) + `"}]}`
	many := `{"tickets": [` + strings.TrimSuffix(strings.Repeat(`{},`, MaxTicketsPerBatch+1), ",") + `]}`
	tests := []struct {
		name, service, method, path, body string
		header                            []string
		wantStatus                        int
		wantCode                          string
		wantMsg                           string
	}{
		{"tickets: no key", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{}]}`, nil, 400, CodeIdempotencyKeyMissing, "Idempotency-Key"},
		{"tickets: key twice", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{}]}`, []string{key, "a", key, "b"}, 400, CodeInvalidRequest, "appears 2 times"},
		{"tickets: empty key", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{}]}`, []string{key, `""`}, 400, CodeInvalidRequest, "Idempotency-Key is empty"},
		{"tickets: long key", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{}]}`, []string{key, strings.Repeat("k", MaxKeyBytes+1)}, 400, CodeInvalidRequest, "Idempotency-Key is 256 bytes"},
		{"tickets: empty body", NameTickets, "POST", "/v1/tickets/batch", ``, []string{key, "k"}, 400, CodeInvalidRequest, "empty"},
		{"tickets: malformed", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [`, []string{key, "k"}, 400, CodeInvalidRequest, "malformed JSON"},
		{"tickets: syntax", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [}`, []string{key, "k"}, 400, CodeInvalidRequest, "malformed JSON at byte"},
		{"tickets: array body", NameTickets, "POST", "/v1/tickets/batch", `[{}]`, []string{key, "k"}, 400, CodeInvalidRequest, "JSON array; want an object"},
		{"tickets: missing", NameTickets, "POST", "/v1/tickets/batch", `{}`, []string{key, "k"}, 400, CodeInvalidRequest, `"tickets" is required`},
		{"tickets: null", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": null}`, []string{key, "k"}, 400, CodeInvalidRequest, `"tickets" is required`},
		{"tickets: empty list", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": []}`, []string{key, "k"}, 400, CodeInvalidRequest, `"tickets" is empty`},
		{"tickets: too many", NameTickets, "POST", "/v1/tickets/batch", many, []string{key, "k"}, 400, CodeInvalidRequest, `"tickets" has 101 items`},
		{"tickets: wrong type", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": {}}`, []string{key, "k"}, 400, CodeInvalidRequest, `field "tickets" is a JSON object; want an array`},
		{"tickets: item not object", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{}, 7]}`, []string{key, "k"}, 400, CodeInvalidRequest, "tickets[1] is a JSON number"},
		{"tickets: report_id type", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{"report_id": 7}]}`, []string{key, "k"}, 400, CodeInvalidRequest, "tickets[0].report_id is a JSON number"},
		{"tickets: unknown field", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{}], "extra": 1}`, []string{key, "k"}, 400, CodeInvalidRequest, `unknown field "extra"`},
		{"tickets: trailing data", NameTickets, "POST", "/v1/tickets/batch", `{"tickets": [{}]} {}`, []string{key, "k"}, 400, CodeInvalidRequest, "after the JSON object"},
		{"tickets: too large", NameTickets, "POST", "/v1/tickets/batch", big, []string{key, "k"}, 400, CodeBodyTooLarge, "1048576"},
		{"tickets: method", NameTickets, "GET", "/v1/tickets/batch", ``, nil, 405, CodeMethodNotAllowed, "POST"},
		{"payments: no key", NamePayments, "POST", "/v1/charges", `{"amount_cents": 1, "currency": "usd", "order_id": "o"}`, nil, 400, CodeIdempotencyKeyMissing, "Idempotency-Key"},
		{"payments: amount string", NamePayments, "POST", "/v1/charges", `{"amount_cents": "1", "currency": "usd", "order_id": "o"}`, []string{key, "k"}, 400, CodeInvalidRequest, `"amount_cents" is a JSON string; want an integer`},
		{"payments: amount fraction", NamePayments, "POST", "/v1/charges", `{"amount_cents": 12.5, "currency": "usd", "order_id": "o"}`, []string{key, "k"}, 400, CodeInvalidRequest, `"amount_cents" is a JSON number 12.5`},
		{"payments: amount zero", NamePayments, "POST", "/v1/charges", `{"amount_cents": 0, "currency": "usd", "order_id": "o"}`, []string{key, "k"}, 400, CodeInvalidRequest, `"amount_cents" is 0`},
		{"payments: amount missing", NamePayments, "POST", "/v1/charges", `{"currency": "usd", "order_id": "o"}`, []string{key, "k"}, 400, CodeInvalidRequest, `"amount_cents" is required`},
		{"payments: currency missing", NamePayments, "POST", "/v1/charges", `{"amount_cents": 1, "order_id": "o"}`, []string{key, "k"}, 400, CodeInvalidRequest, `"currency" is required`},
		{"payments: currency case", NamePayments, "POST", "/v1/charges", `{"amount_cents": 1, "currency": "USD", "order_id": "o"}`, []string{key, "k"}, 400, CodeInvalidRequest, `"currency" is "USD"`},
		{"payments: order missing", NamePayments, "POST", "/v1/charges", `{"amount_cents": 1, "currency": "usd"}`, []string{key, "k"}, 400, CodeInvalidRequest, `"order_id" is required`},
		{"payments: order type", NamePayments, "POST", "/v1/charges", `{"amount_cents": 1, "currency": "usd", "order_id": 5}`, []string{key, "k"}, 400, CodeInvalidRequest, `"order_id" is a JSON number`},
		{"payments: unknown charge", NamePayments, "GET", "/v1/charges/ch_000009", ``, nil, 404, CodeNotFound, "ch_000009"},
		{"records: empty body", NameRecords, "PUT", "/v1/records/k", ``, nil, 400, CodeInvalidRequest, "empty"},
		{"records: malformed", NameRecords, "PUT", "/v1/records/k", `{"a":`, nil, 400, CodeInvalidRequest, "malformed JSON"},
		{"records: trailing data", NameRecords, "PUT", "/v1/records/k", `1 2`, nil, 400, CodeInvalidRequest, "after the JSON value"},
		{"records: long key", NameRecords, "PUT", "/v1/records/" + strings.Repeat("k", MaxKeyBytes+1), `1`, nil, 400, CodeInvalidRequest, "record key is 256 bytes"},
		{"records: control key", NameRecords, "PUT", "/v1/records/a%00b", `1`, nil, 400, CodeInvalidRequest, "record key contains a control character"},
		{"records: no key", NameRecords, "GET", "/v1/records/", ``, nil, 400, CodeInvalidRequest, "record key is empty"},
		{"records: too large", NameRecords, "PUT", "/v1/records/k", `"` + strings.Repeat("x", MaxBodyBytes) + `"`, nil, 400, CodeBodyTooLarge, "exceeds"},
		{"mail: to missing", NameMail, "POST", "/v1/send", `{"subject": "s"}`, nil, 400, CodeInvalidRequest, `"to" is required`},
		{"mail: subject type", NameMail, "POST", "/v1/send", `{"to": "a@b", "subject": 1}`, nil, 400, CodeInvalidRequest, `"subject" is a JSON number`},
		{"mail: string body", NameMail, "POST", "/v1/send", `"hello"`, nil, 400, CodeInvalidRequest, "JSON string; want an object"},
		{"mail: method", NameMail, "GET", "/v1/send", ``, nil, 405, CodeMethodNotAllowed, "POST"},
		{"mail: no route", NameMail, "GET", "/v2/send", ``, nil, 404, CodeNotFound, "/v2/send"},
		{"stats: method", NameMail, "POST", "/v1/_stats", `{}`, nil, 405, CodeMethodNotAllowed, "GET"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tt.service, Options{})
			r, err := b.send(tt.method, tt.path, tt.body, tt.header...)
			if err != nil {
				t.Fatal(err)
			}
			r.wantError(t, tt.wantStatus, tt.wantCode, tt.wantMsg)
			if tt.wantStatus == http.StatusMethodNotAllowed && r.header.Get("Allow") == "" {
				t.Error("405 without an Allow header")
			}
			if s := b.stats(); len(s.Effects) != 0 {
				t.Errorf("bad input performed effects: %v", s.Effects)
			}
		})
	}
}

func TestNewErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		service string
		opts    Options
		wantErr error
		wantMsg string
	}{
		{"unknown service", "fax", Options{Dir: t.TempDir()}, ErrUnknownService, `"fax"`},
		{"no dir", NameMail, Options{}, nil, "Dir is required"},
		{"negative delay", NameMail, Options{Dir: t.TempDir(), Delay: -1}, nil, "Delay"},
		{"negative fail next", NameMail, Options{Dir: t.TempDir(), FailNext: -1}, nil, "FailNext"},
		{"bad base URL", NameMail, Options{Dir: t.TempDir(), BaseURL: "example.com"}, nil, "BaseURL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s, err := New(tt.service, tt.opts)
			if err == nil {
				_ = s.Close()
				t.Fatal("New succeeded")
			}
			if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Errorf("error %v, want %v", err, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q, want it to contain %q", err, tt.wantMsg)
			}
		})
	}
}

func TestClosedServiceAnswers503(t *testing.T) {
	t.Parallel()
	b := setup(t, NameRecords, Options{})
	if err := b.run.Service.Close(); err != nil {
		t.Fatal(err)
	}
	b.must("PUT", "/v1/records/k", `1`).wantError(t, http.StatusServiceUnavailable, CodeUnavailable, "closed")
	if err := b.run.Service.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}
