package demo

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
)

// FuzzRequests sends arbitrary bodies and keys to every service: no panic,
// a known status, and a JSON answer (an ErrorResponse with a code when it
// is an error).
func FuzzRequests(f *testing.F) {
	f.Add(uint8(0), "k", []byte(`{"to": "a@b", "subject": "s"}`))
	f.Add(uint8(1), "k", []byte(`{"amount_cents": 1, "currency": "usd", "order_id": "o"}`))
	f.Add(uint8(2), "job/step", []byte(`{"a": [1, 2.0, "x", null, true]}`))
	f.Add(uint8(3), `"k"`, []byte(`{"tickets": [{"report_id": "r", "title": "\u00e9<>&"}]}`))
	f.Add(uint8(3), "k", []byte(`{"tickets": [{"a": 1e400}]}`))
	f.Add(uint8(1), "k", []byte(`{"amount_cents": 9223372036854775808, "currency": "usd", "order_id": "o"}`))
	svcs := make([]*Service, len(Names()))
	for i, name := range Names() {
		s, err := New(name, Options{Dir: f.TempDir()})
		if err != nil {
			f.Fatal(err)
		}
		f.Cleanup(func() { _ = s.Close() })
		svcs[i] = s
	}
	f.Fuzz(func(t *testing.T, which uint8, key string, body []byte) {
		s := svcs[int(which)%len(svcs)]
		method, path := "POST", map[string]string{
			NameMail: "/v1/send", NamePayments: "/v1/charges", NameTickets: "/v1/tickets/batch",
		}[s.Name()]
		if s.Name() == NameRecords {
			method, path = "PUT", "/v1/records/r"+strconv.Itoa(len(body))
		}
		req := httptest.NewRequest(method, path, strings.NewReader(string(body)))
		if key != "" && !strings.ContainsAny(key, "\r\n\x00") {
			req.Header.Set(IdempotencyKeyHeader, key)
		}
		w := httptest.NewRecorder()
		s.ServeHTTP(w, req)
		switch w.Code {
		case 200, 201, 400, 409, 422:
		default:
			t.Fatalf("status %d: %s", w.Code, w.Body)
		}
		if !json.Valid(w.Body.Bytes()) {
			t.Fatalf("answer is not JSON: %q", w.Body)
		}
		if w.Code >= 400 {
			var e ErrorResponse
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Code == "" || e.Error.Message == "" {
				t.Fatalf("error answer %s: %v", w.Body, err)
			}
		}
		if w.Code == http.StatusOK && s.Name() != NameRecords && w.Header().Get(ReplayedHeader) != "true" {
			t.Fatalf("200 without %s", ReplayedHeader)
		}
	})
}
