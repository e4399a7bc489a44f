package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"runtime/debug"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/schemas"
)

// ServiceName is the name the job control service registers under: the
// NATS service API (ADR-32) answers for it on $SRV.PING.waymark,
// $SRV.INFO.waymark and $SRV.STATS.waymark, and `nats micro ls` lists it.
const ServiceName = "waymark"

// ServiceVersion is the version the service announces when the binary's
// own version is not semantic (a development build says "dev"); the
// binary's version is then in the service's "build" metadata.
const ServiceVersion = "0.1.0"

// ServiceTimeout bounds each request the service handles: a control
// request the engine has not recorded by then answers "202" (it waits in
// the job's inbox). Requesters should wait a little longer than this.
const ServiceTimeout = 30 * time.Second

// ServiceRequest is the body of a request to the job control service: one
// JSON object, decoded strictly (a field the endpoint does not take, a
// second value after the object or text that is not UTF-8 is refused
// with "400", naming it). Job is always required; By on every endpoint
// but job.get; Gate on job.approve and job.reject.
//
//	job.get                   {"job"}
//	job.cancel                {"job", "by", "reason"?}
//	job.pause, job.resume     {"job", "by", "reason"?}
//	job.retry                 {"job", "by", "reason"?, "from"?}
//	job.approve, job.reject   {"job", "gate", "by", "reason"?, "digest"?}
//	job.signal                {"job", "name", "by", "data"?, "id"?}
type ServiceRequest struct {
	// Job is the job's id.
	Job string `json:"job"`
	// By says who acts; Reason why (both at most 1,000 characters of
	// text on one line).
	By     string `json:"by,omitempty"`
	Reason string `json:"reason,omitempty"`
	// From is where a retry goes on (a step id); empty: the step that
	// failed.
	From string `json:"from,omitempty"`
	// Gate is the approval gate decided: its step's id.
	Gate string `json:"gate,omitempty"`
	// Digest is the action decided as the caller saw it; empty: the open
	// gate's.
	Digest string `json:"digest,omitempty"`
	// Name, Data and ID are a signal's (job.signal): its name, its data
	// (any JSON value) and its id (a repeat with the same id is one
	// signal).
	Name string          `json:"name,omitempty"`
	Data json.RawMessage `json:"data,omitempty"`
	ID   string          `json:"id,omitempty"`
}

// ServiceError is the data of an error answer of the job control service:
// {"error": {"code", "message"}}, with "job" the job's record when the
// request was refused after it took effect on the job (an approval that
// expired first, a cancel of a job that had ended).
type ServiceError struct {
	Error ServiceErrorDetail `json:"error"`
	Job   *client.JobView    `json:"job,omitempty"`
}

// ServiceErrorDetail says what went wrong: Code is the HTTP API's error
// code (input_invalid, not_found, conflict, approval_expired, forbidden,
// pending, internal, ...), Message the error, as in the
// Nats-Service-Error header.
type ServiceErrorDetail struct {
	Code    schemas.Code `json:"code"`
	Message string       `json:"message"`
}

// serviceEndpoint is one endpoint of the service: its subject under
// "<prefix>.api", the request fields it takes and what it does.
type serviceEndpoint struct {
	subject string
	fields  []string
	about   string
	call    func(context.Context, ServiceRequest) (*client.JobView, error)
}

// StartService registers the job control service on nc: the NATS service
// API of ADR-32 (github.com/nats-io/nats.go/micro), named ServiceName,
// whose endpoints call c. The endpoints listen on
// "<prefix>.api.job.<op>" in the queue group "q", so that the engines of
// a deployment share the requests:
//
//	<prefix>.api.job.get      the job's record
//	<prefix>.api.job.cancel   client.Client.Cancel
//	<prefix>.api.job.pause    client.Client.Pause
//	<prefix>.api.job.resume   client.Client.Resume
//	<prefix>.api.job.retry    client.Client.Retry
//	<prefix>.api.job.approve  client.Client.Approve
//	<prefix>.api.job.reject   client.Client.Reject
//
// The request is a ServiceRequest. A success answers the job's record
// (client.JobView as JSON). An error answers with micro's error headers
// (Nats-Service-Error-Code and Nats-Service-Error) and a ServiceError as
// data; the code is the HTTP API's status for the same error: "400" bad
// request (schemas.ErrInputInvalid), "403" not an approver
// (client.ErrNotApprover), "404" no such job or gate (schemas.ErrNotFound,
// client.ErrNoSuchGate), "409" not applicable, already decided, digest
// mismatch, approval expired (with the record), cancel of a job that had
// ended (with the record), quarantined; "202" when no engine recorded the
// request within ServiceTimeout (client.ErrControlPending,
// client.ErrCancelPending: it waits in the job's inbox); "500" otherwise
// (logged to log).
//
// prefix is the deployment's subject prefix (kv.Config.Prefix); empty
// takes c's store's. version is the binary's version: a semantic version
// ("1.2.3" or "v1.2.3") is announced as the service's, anything else
// ("dev") announces ServiceVersion. log may be nil.
//
// Each endpoint answers its requests one at a time (one subscription);
// each request runs under a ServiceTimeout context. The service stops
// with its Stop (which drains its subscriptions) or when nc closes.
func StartService(nc *nats.Conn, c *client.Client, prefix, version string, log *slog.Logger) (micro.Service, error) {
	if nc == nil || c == nil {
		return nil, errors.New("nats service: a connection and a client are required")
	}
	if prefix == "" {
		prefix = c.Store().Config.Prefix
	}
	if prefix == "" || strings.ContainsAny(prefix, " \t\r\n.*>") {
		return nil, fmt.Errorf("nats service: prefix %q: want one subject token", prefix)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	svcVersion := ServiceVersion
	if v := strings.TrimPrefix(version, "v"); semver.MatchString(v) {
		svcVersion = v
	}
	svc, err := micro.AddService(nc, micro.Config{
		Name:        ServiceName,
		Version:     svcVersion,
		Description: "Waymark job control: get, cancel, pause, resume, retry, approve and reject jobs",
		Metadata:    map[string]string{"prefix": prefix, "build": version},
	})
	if err != nil {
		return nil, fmt.Errorf("nats service: %w", err)
	}
	control := func(call func(context.Context, string, client.ControlRequest) (*client.JobView, error)) func(context.Context, ServiceRequest) (*client.JobView, error) {
		return func(ctx context.Context, r ServiceRequest) (*client.JobView, error) {
			return call(ctx, r.Job, client.ControlRequest{By: r.By, Reason: r.Reason, From: r.From})
		}
	}
	decide := func(call func(context.Context, string, string, client.ControlRequest) (*client.JobView, error)) func(context.Context, ServiceRequest) (*client.JobView, error) {
		return func(ctx context.Context, r ServiceRequest) (*client.JobView, error) {
			return call(ctx, r.Job, r.Gate, client.ControlRequest{By: r.By, Reason: r.Reason, Digest: r.Digest})
		}
	}
	endpoints := []serviceEndpoint{
		{"job.get", []string{"job"}, "the job's record", func(ctx context.Context, r ServiceRequest) (*client.JobView, error) {
			return c.Job(ctx, r.Job)
		}},
		{"job.cancel", []string{"job", "by", "reason"}, "cancel the job; the record once cancelled", func(ctx context.Context, r ServiceRequest) (*client.JobView, error) {
			v, err := c.Cancel(ctx, r.Job, client.CancelRequest{By: r.By, Reason: r.Reason})
			if err == nil && v.Status != schemas.JobCancelled {
				return v, &endedError{job: r.Job, status: v.Status}
			}
			return v, err
		}},
		{"job.pause", []string{"job", "by", "reason"}, "hold new dispatches; the record once paused", control(c.Pause)},
		{"job.resume", []string{"job", "by", "reason"}, "lift a pause; the record once resumed", control(c.Resume)},
		{"job.retry", []string{"job", "by", "reason", "from"}, "reopen a failed job at from or the failed step; the record once reopened", control(c.Retry)},
		{"job.approve", []string{"job", "gate", "by", "reason", "digest"}, "approve the job's open gate; the record once decided", decide(c.Approve)},
		{"job.reject", []string{"job", "gate", "by", "reason", "digest"}, "reject the job's open gate; the record once decided", decide(c.Reject)},
		{"job.signal", []string{"job", "name", "by", "data", "id"}, "send a named signal to the job's wait steps; the record once recorded (under signals)", func(ctx context.Context, r ServiceRequest) (*client.JobView, error) {
			v, _, err := c.Signal(ctx, r.Job, client.SignalRequest{Name: r.Name, Data: r.Data, By: r.By, ID: r.ID})
			return v, err
		}},
	}
	g := svc.AddGroup(prefix + ".api")
	for _, ep := range endpoints {
		name := strings.ReplaceAll(ep.subject, ".", "_") // endpoint names take no dots
		err := g.AddEndpoint(name, serviceHandler(ep, log),
			micro.WithEndpointSubject(ep.subject),
			micro.WithEndpointMetadata(map[string]string{"description": ep.about, "fields": strings.Join(ep.fields, ", ")}))
		if err != nil {
			_ = svc.Stop()
			return nil, fmt.Errorf("nats service: endpoint %s: %w", ep.subject, err)
		}
	}
	return svc, nil
}

// semver is the semantic version rule micro checks a service's version
// against (https://semver.org).
var semver = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)

// endedError is a cancel of a job that had ended first: nothing changed.
type endedError struct {
	job    string
	status schemas.JobStatus
}

func (e *endedError) Error() string {
	return fmt.Sprintf("cancel job %s: it had ended (%s) before the cancel; nothing changed", e.job, e.status)
}

// serviceHandler answers ep's requests.
func serviceHandler(ep serviceEndpoint, log *slog.Logger) micro.HandlerFunc {
	op := strings.TrimPrefix(ep.subject, "job.")
	return func(req micro.Request) {
		defer func() {
			if p := recover(); p != nil {
				log.Error("nats service: handler panicked", "endpoint", ep.subject, "panic", p, "stack", string(debug.Stack()))
				respondError(req, log, ep.subject, "500", ServiceErrorDetail{Code: "internal", Message: fmt.Sprintf("%s: internal error", ep.subject)}, nil)
			}
		}()
		r, err := decodeServiceRequest(req.Data(), ep)
		if err != nil {
			failService(req, log, ep.subject, op, "", nil, err)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), ServiceTimeout)
		defer cancel()
		v, err := ep.call(ctx, r)
		if err != nil {
			failService(req, log, ep.subject, op, r.Job, v, err)
			return
		}
		if err := req.Respond(marshalJSON(v)); err != nil {
			log.Debug("nats service: answer", "endpoint", ep.subject, "job", r.Job, "err", err)
		}
	}
}

// decodeServiceRequest decodes data as a ServiceRequest holding only the
// fields ep takes; Job, By (but for job.get) and Gate (for approve and
// reject) are required.
func decodeServiceRequest(data []byte, ep serviceEndpoint) (ServiceRequest, error) {
	var r ServiceRequest
	if err := decodeStrict(data, &r); err != nil {
		// A decoder reads a cut-off document as "unexpected EOF": say so
		// in the terms of the JSON.
		var se *json.SyntaxError
		if jerr := json.Unmarshal(data, new(any)); len(bytes.TrimSpace(data)) > 0 && errors.As(jerr, &se) && strings.Contains(se.Error(), "unexpected end") {
			return r, badRequest("request body: not valid JSON: it ends at byte %d before the value does", se.Offset)
		}
		return r, err
	}
	if err := schemas.CheckJSONText(data); err != nil {
		return r, fmt.Errorf("request body: %w", err)
	}
	// decodeStrict matches names regardless of case and knows every
	// endpoint's fields: the endpoint takes its own, as written.
	var given map[string]json.RawMessage
	if err := json.Unmarshal(data, &given); err != nil || given == nil {
		return r, badRequest("request body: want a JSON object")
	}
	for k := range given {
		if !slices.Contains(ep.fields, k) {
			return r, badRequest("request body: unknown field %q: %s takes %s", printable(k), ep.subject, strings.Join(ep.fields, ", "))
		}
	}
	switch {
	case r.Job == "":
		return r, badRequest("request body: job is required (the job's id)")
	case r.Name == "" && slices.Contains(ep.fields, "name"):
		return r, badRequest("signal job %s: name is required (the signal's name)", r.Job)
	case r.Gate == "" && slices.Contains(ep.fields, "gate"):
		return r, badRequest("%s job %s: gate is required (the approval step's id)", strings.TrimPrefix(ep.subject, "job."), r.Job)
	}
	return r, nil
}

// printable is s with control characters written as Go escapes, for a
// message.
func printable(s string) string {
	q := fmt.Sprintf("%q", s)
	return q[1 : len(q)-1]
}

// failService answers err in the HTTP API's terms: the same status (as
// the error code) and {"error": {"code", "message"}} as data.
func failService(req micro.Request, log *slog.Logger, subject, op, job string, v *client.JobView, err error) {
	status, code := serviceStatus(err)
	body := ServiceError{Error: ServiceErrorDetail{Code: code, Message: withoutCode(err.Error(), err, code)}}
	switch {
	case status == "202":
		body.Error.Message = fmt.Sprintf("no engine recorded the %s of job %s within %s: it waits in the job's inbox, and the next engine to run applies it", op, job, ServiceTimeout)
	case v != nil && (errors.Is(err, client.ErrApprovalExpired) || errors.As(err, new(*endedError))):
		body.Job = v
	case status == "500":
		log.Error("nats service", "endpoint", subject, "job", job, "err", err)
	}
	respondError(req, log, subject, status, body.Error, body.Job)
}

// respondError sends micro's error answer: code and description in its
// headers, a ServiceError as data.
func respondError(req micro.Request, log *slog.Logger, subject, status string, e ServiceErrorDetail, v *client.JobView) {
	desc := strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' ' // a header value is one line
		}
		return r
	}, e.Message)
	if strings.TrimSpace(desc) == "" {
		desc = string(e.Code)
	}
	if err := req.Error(status, desc, marshalJSON(ServiceError{Error: e, Job: v})); err != nil {
		log.Debug("nats service: answer", "endpoint", subject, "err", err)
	}
}

// serviceStatus maps err to the status the HTTP API answers it with (see
// API.fail and controlWith), and its error code.
func serviceStatus(err error) (string, schemas.Code) {
	var de *schemas.DefinitionError
	switch {
	case errors.Is(err, client.ErrControlPending), errors.Is(err, client.ErrCancelPending):
		return "202", "pending"
	case errors.As(err, &de):
		return "400", schemas.CodeDefinitionInvalid
	case errors.Is(err, schemas.ErrNotFound):
		return "404", schemas.CodeNotFound
	case errors.Is(err, schemas.ErrInputInvalid), errors.Is(err, schemas.ErrDefinitionInvalid):
		return "400", schemas.AsError(err).Code
	case errors.Is(err, schemas.ErrQuarantined):
		return "409", schemas.CodeQuarantined
	case errors.Is(err, schemas.ErrTooLarge):
		return "413", schemas.CodeTooLarge
	case errors.Is(err, client.ErrNotAmbiguous), errors.Is(err, schemas.ErrConflict),
		errors.Is(err, client.ErrNotApplicable), errors.Is(err, client.ErrAlreadyDecided), errors.Is(err, client.ErrDigestMismatch),
		errors.As(err, new(*endedError)):
		return "409", schemas.CodeConflict
	case errors.Is(err, client.ErrApprovalExpired):
		return "409", schemas.CodeApprovalExpired
	case errors.Is(err, client.ErrNotApprover):
		return "403", "forbidden"
	case errors.Is(err, client.ErrNoSuchGate), errors.Is(err, client.ErrNoSuchSignal):
		return "404", schemas.CodeNotFound
	}
	return "500", "internal"
}

// marshalJSON is v as JSON, HTML left as it was given (as the HTTP API
// answers it).
func marshalJSON(v any) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return []byte(`{"error": {"code": "internal", "message": "encode the answer"}}`)
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}
