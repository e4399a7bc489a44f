package trigger_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/waymark-dev/waymark/engine/trigger"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// FuzzIntakeHTTP posts arbitrary requests (content type, ce- headers,
// body) to the intake: it never panics, never answers 200 or 500, and
// every refusal is a JSON error with a code.
func FuzzIntakeHTTP(f *testing.F) {
	srv := testsupport.StartServer(f, testsupport.ServerOptions{})
	st := srv.Store(f, kv.Config{})
	def, err := schemas.Load("testdata/orders.yaml", schemas.LoadOptions{})
	if err != nil {
		f.Fatal(err)
	}
	if err := st.Definitions.Put(context.Background(), def); err != nil {
		f.Fatal(err)
	}
	in, err := trigger.New(trigger.Config{Store: st})
	if err != nil {
		f.Fatal(err)
	}
	f.Add("application/json", "1.0", "f-1", "/shop/eu", "com.example.order.created", "", []byte(`{"order_id":"o","amount":1}`))
	f.Add("application/cloudevents+json", "", "", "", "", "", []byte(`{"specversion":"1.0","id":"f-2","source":"/shop/eu","type":"com.example.order.created","data":{"order_id":"o","amount":1}}`))
	f.Add("application/cloudevents-batch+json", "", "", "", "", "", []byte(`[{"specversion":"1.0","id":"f-3","source":"/s","type":"t"}]`))
	f.Add("text/plain", "1.0", "f-4", "/s", "com.example.order.paid", "2020-13-01T00:00:00Z", []byte("x"))
	f.Add("application/cloudevents+json", "", "", "", "", "", []byte(`{"specversion":"1.0","id":"f-5","source":"/s","type":"t","data_base64":"!!"}`))
	f.Add("", "0.3", "f-6", "/s", "t", "", []byte(nil))
	f.Add("application/cloudevents-batch+json", "", "", "", "", "", []byte(`[{"specversion":"1.0"},]`))
	f.Fuzz(func(t *testing.T, ct, spec, id, source, typ, tm string, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "/v1/events", bytes.NewReader(body))
		for k, v := range map[string]string{"Content-Type": ct, "Ce-Specversion": spec, "Ce-Id": id, "Ce-Source": source, "Ce-Type": typ, "Ce-Time": tm} {
			if v != "" {
				req.Header.Set(k, v)
			}
		}
		rec := httptest.NewRecorder()
		in.ServeHTTP(rec, req)
		switch rec.Code {
		case http.StatusAccepted, http.StatusMultiStatus:
			return
		case http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType, http.StatusUnprocessableEntity:
		default:
			t.Fatalf("status %d for %q %q: %s", rec.Code, ct, body, rec.Body)
		}
		var ans struct{ Error *trigger.Refusal }
		if err := json.Unmarshal(rec.Body.Bytes(), &ans); err != nil || ans.Error == nil || ans.Error.Code == "" || ans.Error.Message == "" {
			t.Fatalf("refusal %d is not a JSON error with a code: %s", rec.Code, rec.Body)
		}
	})
}
