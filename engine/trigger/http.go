package trigger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/format"
	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/waymark-dev/waymark/schemas"
)

// Result is one event's outcome in a batch answer: its Answer's fields,
// or Error.
type Result struct {
	Event EventRef    `json:"event"`
	Jobs  []JobAnswer `json:"jobs,omitempty"`
	Error *Refusal    `json:"error,omitempty"`
}

// ServeHTTP serves POST /v1/events: one CloudEvent in binary mode (ce-
// headers, the body is the data) or structured mode (Content-Type
// application/cloudevents+json), or a batch (application/cloudevents-
// batch+json, at most MaxBatch events), read with sdk-go's HTTP binding.
//
//	202 Answer                          the event's jobs are stored (duplicate: true when it came before)
//	202 {"results": [Result...]}        a batch, every event accepted; 207 when some were refused
//	400 {"error": Refusal}              not a valid CloudEvent (event_invalid, attribute names what), or a refused filter
//	413                                 over MaxEventBytes (too_large)
//	415                                 a content type that is neither a CloudEvents format read here nor binary mode
//	422                                 no trigger takes it (no_trigger, with the live triggers), or its mapped input
//	                                    breaks the workflow's input schema (input_invalid, with the JSON pointers)
//	500                                 storage failed: deliver the event again (it attaches to what it started)
//
// GET (any path) answers {"triggers": [Rule...]}, the live triggers.
func (in *Intake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet {
		rules, err := in.Triggers(r.Context())
		if err != nil {
			in.writeError(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"triggers": rules})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), in.timeout)
	defer cancel()
	r.Body = http.MaxBytesReader(w, r.Body, MaxEventBytes)
	msg := cehttp.NewMessageFromHttpRequest(r)
	defer func() { _ = msg.Finish(nil) }()
	switch msg.ReadEncoding() {
	case binding.EncodingBinary, binding.EncodingStructured:
		ev, err := binding.ToEvent(ctx, msg)
		if err != nil {
			in.invalid.Add(1)
			in.writeError(w, r, readError(err))
			return
		}
		a, err := in.Accept(ctx, ev)
		if err != nil {
			in.writeError(w, r, err)
			return
		}
		writeJSON(w, http.StatusAccepted, a)
	case binding.EncodingBatch:
		evs, err := binding.ToEvents(ctx, msg, msg.BodyReader)
		if err != nil {
			in.invalid.Add(1)
			in.writeError(w, r, readError(err))
			return
		}
		in.serveBatch(ctx, w, r, evs)
	default:
		in.invalid.Add(1)
		in.writeError(w, r, unknownEncoding(r.Header))
	}
}

// serveBatch accepts a batch: every event is validated first (one that is
// not valid refuses the batch, naming its index, before anything starts),
// then each is accepted on its own.
func (in *Intake) serveBatch(ctx context.Context, w http.ResponseWriter, r *http.Request, evs []event.Event) {
	if len(evs) == 0 {
		in.writeError(w, r, &Refusal{Code: schemas.CodeEventInvalid, Message: "the batch holds no events"})
		return
	}
	if len(evs) > MaxBatch {
		in.writeError(w, r, &Refusal{Code: schemas.CodeTooLarge, Message: fmt.Sprintf("the batch holds %d events; the limit is %d", len(evs), MaxBatch)})
		return
	}
	for i := range evs {
		if err := evs[i].Validate(); err != nil {
			in.invalid.Add(1)
			ref := invalidEvent(err)
			ref.Message = fmt.Sprintf("batch event %d: %s", i, ref.Message)
			in.writeError(w, r, ref)
			return
		}
	}
	status := http.StatusAccepted
	results := make([]Result, 0, len(evs))
	for i := range evs {
		a, err := in.Accept(ctx, &evs[i])
		if err != nil {
			var ref *Refusal
			if !errors.As(err, &ref) {
				in.writeError(w, r, fmt.Errorf("batch event %d: %w", i, err))
				return
			}
			status = http.StatusMultiStatus
			results = append(results, Result{Event: EventRef{Source: evs[i].Source(), ID: evs[i].ID()}, Error: ref})
			continue
		}
		results = append(results, Result{Event: a.Event, Jobs: a.Jobs})
	}
	writeJSON(w, status, map[string]any{"results": results})
}

// readError words what sdk-go's binding could not read; an over-long
// body is too_large.
func readError(err error) error {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return &Refusal{Code: schemas.CodeTooLarge, Message: fmt.Sprintf("request body is over the limit of %d bytes", mbe.Limit)}
	}
	var se *json.SyntaxError
	if errors.As(err, &se) || errors.Is(err, io.ErrUnexpectedEOF) {
		return &Refusal{Code: schemas.CodeEventInvalid, Message: "not a valid CloudEvent: the body is not JSON: " + err.Error()}
	}
	return invalidEvent(err)
}

// unknownEncoding says why a request is neither binary nor structured
// mode: an unknown spec version, ce- headers without ce-specversion, a
// CloudEvents format not read here, or no CloudEvent at all.
func unknownEncoding(h http.Header) *Refusal {
	if v := h.Get("Ce-Specversion"); v != "" {
		return &Refusal{Code: schemas.CodeEventInvalid, Attribute: "specversion",
			Message: fmt.Sprintf("not a valid CloudEvent: specversion: unknown spec version %q (this intake reads 1.0 and 0.3)", v)}
	}
	for k := range h {
		if strings.HasPrefix(strings.ToLower(k), "ce-") {
			return &Refusal{Code: schemas.CodeEventInvalid, Attribute: "specversion",
				Message: "not a valid CloudEvent: specversion: missing (a binary-mode request needs the ce-specversion header)"}
		}
	}
	ct := h.Get("Content-Type")
	mt, _, _ := mime.ParseMediaType(ct)
	switch {
	case ct == "":
		return &Refusal{Code: schemas.CodeEventInvalid, Attribute: "specversion",
			Message: "not a CloudEvent: no ce-specversion header (binary mode) and no Content-Type (application/cloudevents+json for structured mode)"}
	case format.IsFormat(mt):
		return &Refusal{Code: schemas.CodeUnsupportedMedia,
			Message: fmt.Sprintf("Content-Type %q is a CloudEvents format this intake does not read; send application/cloudevents+json, application/cloudevents-batch+json, or binary mode (ce- headers)", ct)}
	}
	return &Refusal{Code: schemas.CodeUnsupportedMedia,
		Message: fmt.Sprintf("Content-Type %q without ce- headers is not a CloudEvent: send the event in binary mode (ce-specversion, ce-id, ce-source, ce-type headers; the body is the data) or structured mode (Content-Type application/cloudevents+json)", ct)}
}

// Status is the HTTP status of an Accept error (and the
// Nats-Service-Error-Code of the NATS answer).
func Status(err error) int {
	var ref *Refusal
	if !errors.As(err, &ref) {
		return http.StatusInternalServerError
	}
	switch ref.Code {
	case schemas.CodeEventInvalid:
		return http.StatusBadRequest
	case schemas.CodeUnsupportedMedia:
		return http.StatusUnsupportedMediaType
	case schemas.CodeTooLarge:
		return http.StatusRequestEntityTooLarge
	}
	return http.StatusUnprocessableEntity
}

// errorBody is the answer to an error: {"error": Refusal}; an internal
// error has code "internal".
func errorBody(err error) map[string]*Refusal {
	var ref *Refusal
	if !errors.As(err, &ref) {
		ref = &Refusal{Code: "internal", Message: err.Error()}
	}
	return map[string]*Refusal{"error": ref}
}

func (in *Intake) writeError(w http.ResponseWriter, r *http.Request, err error) {
	status := Status(err)
	if status == http.StatusInternalServerError {
		in.log.Error("events intake", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeJSON(w, status, errorBody(err))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
