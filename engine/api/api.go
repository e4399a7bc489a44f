package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// MaxRequestBytes caps an HTTP API request body.
const MaxRequestBytes = 8 << 20

// API serves the engine's HTTP interface (JSON over HTTP/1.1):
//
//	POST /v1/workflows              body: a workflow definition (YAML or JSON) → {name, version, hash}
//	POST /v1/jobs                   {"workflow" | "definition_hash", "input", "job_id"?, "vars"?} → 201 {job_id, ...}; 200 when attached
//	GET  /v1/jobs?status=&workflow=&limit=&after=  → {"jobs": [...], "cursor"?} newest first; after= the cursor of the previous page
//	GET  /v1/jobs/{id}              → the job record
//	GET  /v1/jobs/{id}/history      → {"events": [...]}
//	POST /v1/jobs/{id}/cancel       {"by", "reason"?} → the cancelled job's record; 409 and its record when it had ended; 202 when no engine recorded it within 30 s
//	POST /v1/jobs/{id}/pause        {"by", "reason"?} → the record once paused; 409 when it ended or is paused already
//	POST /v1/jobs/{id}/resume       {"by", "reason"?} → the record once resumed; 409 when not paused
//	POST /v1/jobs/{id}/retry        {"by", "reason"?, "from"?} → the record once reopened; 409 when it did not fail
//	POST /v1/jobs/{id}/approvals/{gate}/approve  {"by", "reason"?, "digest"?} → the record once decided; 403 not an approver,
//	POST /v1/jobs/{id}/approvals/{gate}/reject   404 no such gate, 409 already decided, changed digest or expired (with the record)
//	POST /v1/jobs/{id}/signals/{name}  {"data"?, "by", "id"?, "start"?: {"workflow", "input"?, "vars"?}} → {"signal", "job"}; 404 no job or
//	     no wait step for the signal, 409 the job ended; with start, the job is started first when it does not exist
//	     (these six answer 202 when no engine recorded the request within 30 s: it waits in the job's inbox)
//	GET  /v1/jobs/{id}/at/{seq}     → the job as it stood at checkpoint sequence seq (client.Snapshot), rebuilt from its history
//	POST /v1/jobs/{id}/rewind       {"to", "by", "reason"?} → {"job", "snapshot"}; 409 when the job is in a state a rewind does not apply to
//	POST /v1/jobs/{id}/fork         {"from", "by", "job_id"?, "set"?: {path: value}} → 201 {job_id, ...}
//	POST /v1/jobs/{id}/migrate      {"to", "patch"?, "by", "reason"?} → the record once moved; 400 a refused migration (the JSON pointers at fault), 409 a job it does not apply to
//	GET  /v1/store/{ns}[/{key}]     → the session store: {"entries": [...]}, or one {namespace, key, value, revision, updated}
//	PUT  /v1/store/{ns}/{key}?revision=N|create=true  body: the JSON value → {revision}; 409 another revision (or a value, with create)
//	DELETE /v1/store/{ns}/{key}?revision=N → 204
//	GET  /v1/effects?job=&state=    → {"effects": [...]} (state: prepared, dispatched, confirmed, ambiguous, reconciled)
//	GET  /v1/effects/{key}          → one effect record (the key may contain '/')
//	POST /v1/effects/resolve        {"key", "happened", "external_id"?, "result"?, "by", "note"?} → the reconciled record
//	POST /v1/events                 a CloudEvent (binary, structured or batch mode) → 202 {event, jobs}; see trigger.Intake.ServeHTTP (when Events is set)
//	GET  /v1/triggers               → {"triggers": [...]} the live trigger rules (when Events is set)
//
// The probes /healthz and /readyz are not the API's: engine serve mounts
// them beside it (internal/health), where they see the NATS connection.
//
// Errors are {"error": {"code", "message", "problems"?}} with 400 for bad
// input (text that is not UTF-8, or a lone surrogate, is named by its JSON
// path), 404 for unknown jobs and workflows, 409 for a job id taken by
// another job, 413 for a body over MaxRequestBytes or an input too large
// to start (too_large), 500 otherwise.
type API struct {
	Client *client.Client
	// Checks run on uploaded definitions besides the schema (transition
	// conditions, known kinds); see schemas.LoadOptions.
	Checks []schemas.CheckFunc
	Logger *slog.Logger
	// Events, when set, serves POST /v1/events (CloudEvents intake) and
	// GET /v1/triggers (the live trigger rules): a *trigger.Intake.
	Events http.Handler
}

// Handler returns the API's routes.
func (a *API) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/workflows", a.putWorkflow)
	mux.HandleFunc("POST /v1/jobs", a.startJob)
	mux.HandleFunc("GET /v1/jobs", a.listJobs)
	mux.HandleFunc("GET /v1/jobs/{id}", a.getJob)
	mux.HandleFunc("GET /v1/jobs/{id}/history", a.getHistory)
	mux.HandleFunc("POST /v1/jobs/{id}/cancel", a.cancelJob)
	mux.HandleFunc("POST /v1/jobs/{id}/pause", a.control("pause", a.Client.Pause))
	mux.HandleFunc("POST /v1/jobs/{id}/resume", a.control("resume", a.Client.Resume))
	mux.HandleFunc("POST /v1/jobs/{id}/retry", a.control("retry", a.Client.Retry))
	mux.HandleFunc("POST /v1/jobs/{id}/approvals/{gate}/approve", a.decision("approve", a.Client.Approve))
	mux.HandleFunc("POST /v1/jobs/{id}/approvals/{gate}/reject", a.decision("reject", a.Client.Reject))
	mux.HandleFunc("POST /v1/jobs/{id}/signals/{name}", a.signalJob)
	mux.HandleFunc("GET /v1/jobs/{id}/at/{seq}", a.jobAt)
	mux.HandleFunc("POST /v1/jobs/{id}/rewind", a.rewindJob)
	mux.HandleFunc("POST /v1/jobs/{id}/fork", a.forkJob)
	mux.HandleFunc("POST /v1/jobs/{id}/migrate", a.migrateJob)
	mux.HandleFunc("GET /v1/store/{ns}", a.storeList)
	mux.HandleFunc("GET /v1/store/{ns}/{key}", a.storeGet)
	mux.HandleFunc("PUT /v1/store/{ns}/{key}", a.storePut)
	mux.HandleFunc("DELETE /v1/store/{ns}/{key}", a.storeDelete)
	mux.HandleFunc("GET /v1/effects", a.listEffects)
	mux.HandleFunc("GET /v1/effects/{key...}", a.getEffect)
	mux.HandleFunc("POST /v1/effects/resolve", a.resolveEffect)
	if a.Events != nil {
		mux.Handle("POST /v1/events", a.Events)
		mux.Handle("GET /v1/triggers", a.Events)
	}
	return jsonErrors(mux)
}

// jsonErrors answers the mux's own 404 and 405 in the API's error shape.
func jsonErrors(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, pattern := mux.Handler(r)
		if pattern != "" {
			mux.ServeHTTP(w, r) // the mux sets the path values
			return
		}
		rec := &statusRecorder{header: http.Header{}}
		h.ServeHTTP(rec, r)
		for k, v := range rec.header {
			if k != "Content-Type" && k != "X-Content-Type-Options" {
				w.Header()[k] = v
			}
		}
		code := schemas.CodeNotFound
		msg := fmt.Sprintf("no route %s %s", r.Method, r.URL.Path)
		if rec.status == http.StatusMethodNotAllowed {
			code, msg = "method_not_allowed", fmt.Sprintf("%s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, rec.header.Get("Allow"))
		}
		writeJSON(w, max(rec.status, http.StatusNotFound), map[string]apiError{"error": {Code: code, Message: msg}})
	})
}

type statusRecorder struct {
	header http.Header
	status int
}

func (s *statusRecorder) Header() http.Header         { return s.header }
func (s *statusRecorder) Write(b []byte) (int, error) { return len(b), nil }
func (s *statusRecorder) WriteHeader(code int)        { s.status = code }

type apiError struct {
	Code     schemas.Code             `json:"code"`
	Message  string                   `json:"message"`
	Problems []schemas.LocatedProblem `json:"problems,omitempty"`
}

func (a *API) fail(w http.ResponseWriter, r *http.Request, err error) {
	status := http.StatusInternalServerError
	body := apiError{Code: "internal", Message: err.Error()}
	var de *schemas.DefinitionError
	switch {
	case errors.As(err, &de):
		status, body.Code, body.Problems = http.StatusBadRequest, schemas.CodeDefinitionInvalid, de.Problems
	case errors.Is(err, schemas.ErrNotFound):
		status, body.Code = http.StatusNotFound, schemas.CodeNotFound
	case errors.Is(err, client.ErrMigration):
		status, body.Code = http.StatusBadRequest, schemas.CodeInputInvalid
	case errors.Is(err, schemas.ErrInputInvalid), errors.Is(err, schemas.ErrDefinitionInvalid):
		status, body.Code = http.StatusBadRequest, schemas.AsError(err).Code
	case errors.Is(err, schemas.ErrQuarantined):
		status, body.Code = http.StatusConflict, schemas.CodeQuarantined
	case errors.Is(err, schemas.ErrTooLarge):
		status, body.Code = http.StatusRequestEntityTooLarge, schemas.CodeTooLarge
	case errors.Is(err, client.ErrNotAmbiguous), errors.Is(err, schemas.ErrConflict),
		errors.Is(err, client.ErrNotApplicable), errors.Is(err, client.ErrAlreadyDecided), errors.Is(err, client.ErrDigestMismatch):
		status, body.Code = http.StatusConflict, schemas.CodeConflict
	case errors.Is(err, client.ErrApprovalExpired):
		status, body.Code = http.StatusConflict, schemas.CodeApprovalExpired
	case errors.Is(err, client.ErrNotApprover):
		status, body.Code = http.StatusForbidden, "forbidden"
	case errors.Is(err, client.ErrNoSuchGate), errors.Is(err, client.ErrNoSuchSignal):
		status, body.Code = http.StatusNotFound, schemas.CodeNotFound
	}
	if status == http.StatusInternalServerError && a.Logger != nil {
		a.Logger.Error("api", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	body.Message = withoutCode(body.Message, err, body.Code)
	writeJSON(w, status, map[string]apiError{"error": body})
}

// withoutCode drops from msg the "code: " that a *schemas.Error of the
// answer's code puts in its text: the code has a field of its own.
func withoutCode(msg string, err error, code schemas.Code) string {
	var se *schemas.Error
	if !errors.As(err, &se) || se.Code != code {
		return msg
	}
	return strings.Replace(msg, string(code)+": ", "", 1)
}

// decodeStrict decodes a request body of one JSON object into v: unknown
// fields, anything after the object and a byte order mark are refused
// (schemas.ErrInputInvalid naming which).
func decodeStrict(data []byte, v any) error {
	if bytes.HasPrefix(data, []byte("\xef\xbb\xbf")) {
		return badRequest("request body: starts with a UTF-8 byte order mark; send the JSON without it")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return badRequest("request body: %s", describeDecodeError(err))
	}
	if _, err := dec.Token(); err != io.EOF {
		return badRequest("request body: more follows the JSON object at byte %d; send one object", dec.InputOffset())
	}
	return nil
}

// describeDecodeError says what was wrong with a request body in the
// terms of its JSON (field path, JSON types), not of the Go types it is
// decoded into.
func describeDecodeError(err error) string {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.Is(err, io.EOF):
		return "empty; send a JSON object"
	case errors.As(err, &se):
		return fmt.Sprintf("not valid JSON at byte %d: %s", se.Offset, strings.TrimPrefix(se.Error(), "json: "))
	case errors.As(err, &te):
		var path []string
		for _, seg := range strings.Split(te.Field, ".") {
			// Embedded Go structs name a segment in capitals; JSON fields
			// here are lower-case.
			if seg != "" && !(seg[0] >= 'A' && seg[0] <= 'Z') {
				path = append(path, seg)
			}
		}
		want := jsonKind(te.Type.Kind())
		if len(path) == 0 {
			return fmt.Sprintf("want %s, got a JSON %s", want, te.Value)
		}
		return fmt.Sprintf("field %q: want %s, got a JSON %s", strings.Join(path, "."), want, te.Value)
	}
	return strings.TrimPrefix(err.Error(), "json: ")
}

// jsonKind names what JSON value decodes into a Go value of kind k.
func jsonKind(k reflect.Kind) string {
	switch k {
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	}
	return "an object"
}

func badRequest(format string, args ...any) error {
	return schemas.Errorf(schemas.CodeInputInvalid, format, args...)
}

// readBody reads a request body of at most MaxRequestBytes; a longer one
// is schemas.ErrTooLarge (413).
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBytes))
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		return nil, schemas.Errorf(schemas.CodeTooLarge, "request body is over the limit of %d bytes", mbe.Limit)
	} else if err != nil {
		return nil, badRequest("read body: %v", err)
	}
	return data, nil
}

func (a *API) putWorkflow(w http.ResponseWriter, r *http.Request) {
	data, err := readBody(w, r)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	def, err := schemas.Parse("request body", data, schemas.LoadOptions{Checks: a.Checks, NoAssetFiles: true})
	if err != nil {
		a.fail(w, r, err)
		return
	}
	if err := a.Client.Store().Definitions.Put(r.Context(), def); err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, map[string]any{"name": def.Name, "version": def.Version, "hash": def.Hash})
}

// StartJobRequest is the body of POST /v1/jobs. Exactly one of Workflow
// (the latest stored version of that name) and DefinitionHash is set.
type StartJobRequest struct {
	Workflow       string            `json:"workflow,omitempty"`
	DefinitionHash string            `json:"definition_hash,omitempty"`
	Input          json.RawMessage   `json:"input"`
	JobID          string            `json:"job_id,omitempty"`
	Vars           map[string]string `json:"vars,omitempty"`
}

func (a *API) startJob(w http.ResponseWriter, r *http.Request) {
	data, err := readBody(w, r)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	var req StartJobRequest
	if err := decodeStrict(data, &req); err != nil {
		a.fail(w, r, err)
		return
	}
	if err := schemas.CheckJSONText(data); err != nil {
		a.fail(w, r, fmt.Errorf("request body: %w", err))
		return
	}
	ctx := r.Context()
	var def *schemas.Definition
	switch {
	case (req.Workflow == "") == (req.DefinitionHash == ""):
		a.fail(w, r, badRequest("set exactly one of workflow and definition_hash"))
		return
	case req.Workflow != "":
		def, err = a.Client.Store().Definitions.Latest(ctx, req.Workflow)
	default:
		def, err = a.Client.Store().Definitions.Get(ctx, req.DefinitionHash)
	}
	if err != nil {
		a.fail(w, r, err)
		return
	}
	res, err := a.Client.Start(ctx, def, req.Input, client.StartOptions{JobID: req.JobID, Vars: req.Vars})
	if err != nil {
		a.fail(w, r, err)
		return
	}
	status := http.StatusCreated
	if res.Attached {
		status = http.StatusOK
	}
	writeJSON(w, status, res)
}

// jobStatuses and effectStates are the values the status and state
// filters accept.
var (
	jobStatuses  = []schemas.JobStatus{schemas.JobPending, schemas.JobRunning, schemas.JobCompleted, schemas.JobFailed, schemas.JobCancelled, schemas.JobNeedsReconciliation, schemas.JobBlocked, schemas.JobQuarantined, schemas.JobWaitingApproval}
	effectStates = []schemas.EffectState{schemas.EffectPrepared, schemas.EffectDispatched, schemas.EffectConfirmed, schemas.EffectAmbiguous, schemas.EffectReconciled}
)

// checkEnum reports a query parameter whose value is not one of allowed
// ("" means no filter).
func checkEnum[T ~string](param string, v T, allowed []T) error {
	if v == "" || slices.Contains(allowed, v) {
		return nil
	}
	names := make([]string, len(allowed))
	for i, a := range allowed {
		names[i] = string(a)
	}
	return badRequest("%s %q: want one of %s", param, v, strings.Join(names, ", "))
}

func (a *API) listJobs(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	if err := checkEnum("status", schemas.JobStatus(q.Get("status")), jobStatuses); err != nil {
		a.fail(w, r, err)
		return
	}
	f := client.ListFilter{Status: schemas.JobStatus(q.Get("status")), Workflow: q.Get("workflow"), After: q.Get("after")}
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 10000 {
			a.fail(w, r, badRequest("limit %q: want 1..10000", s))
			return
		}
		f.Limit = n
	}
	page, err := a.Client.List(r.Context(), f)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, page)
}

func (a *API) getJob(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if err := client.ValidateJobID(id); err != nil {
		a.fail(w, r, err) // 400: no job can have this id
		return
	}
	v, err := a.Client.Job(r.Context(), id)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// cancelJob cancels a job: the body is client.CancelRequest ({"by",
// "reason"?}); the answer is the job's record once the engine recorded
// it, 409 when the job had already ended (its record in the body).
func (a *API) cancelJob(w http.ResponseWriter, r *http.Request) {
	var req client.CancelRequest
	id, ok := a.decodeJobRequest(w, r, &req)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	v, err := a.Client.Cancel(ctx, id, req)
	if err != nil {
		a.failOrPending(w, r, "cancel", id, err)
		return
	}
	if v.Status != schemas.JobCancelled {
		writeJSON(w, http.StatusConflict, v)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// control serves a control request (pause, resume, retry): the body is a
// client.ControlRequest; from only for retry.
func (a *API) control(op string, call func(context.Context, string, client.ControlRequest) (*client.JobView, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		a.controlWith(w, r, op, func(ctx context.Context, id string, req client.ControlRequest) (*client.JobView, error) {
			if req.Digest != "" || (req.From != "" && op != "retry") {
				return nil, schemas.Errorf(schemas.CodeInputInvalid, "%s job %s: only by and reason apply (from is for retry, digest for approve and reject)", op, id)
			}
			return call(ctx, id, req)
		})
	}
}

// decision serves approve and reject of the gate in the path.
func (a *API) decision(op string, call func(context.Context, string, string, client.ControlRequest) (*client.JobView, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		gate := r.PathValue("gate")
		a.controlWith(w, r, op, func(ctx context.Context, id string, req client.ControlRequest) (*client.JobView, error) {
			if req.From != "" {
				return nil, schemas.Errorf(schemas.CodeInputInvalid, "%s job %s: from is for retry", op, id)
			}
			return call(ctx, id, gate, req)
		})
	}
}

func (a *API) controlWith(w http.ResponseWriter, r *http.Request, op string, call func(context.Context, string, client.ControlRequest) (*client.JobView, error)) {
	var req client.ControlRequest
	id, ok := a.decodeJobRequest(w, r, &req)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	v, err := call(ctx, id, req)
	switch {
	case errors.Is(err, client.ErrApprovalExpired) && v != nil:
		writeJSON(w, http.StatusConflict, map[string]any{"error": apiError{Code: schemas.CodeApprovalExpired, Message: err.Error()}, "job": v})
	case err != nil:
		a.failOrPending(w, r, op, id, err)
	default:
		writeJSON(w, http.StatusOK, v)
	}
}

// jobAt answers a job's snapshot at a sequence.
func (a *API) jobAt(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if err := client.ValidateJobID(id); err != nil {
		a.fail(w, r, err)
		return
	}
	seq, err := strconv.ParseUint(r.PathValue("seq"), 10, 64)
	if err != nil {
		a.fail(w, r, schemas.Errorf(schemas.CodeInputInvalid, "seq %q: want a checkpoint sequence (engine history lists them)", r.PathValue("seq")))
		return
	}
	s, err := a.Client.StateAt(r.Context(), id, seq)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s)
}

// rewindJob sets a job back to a sequence (client.Rewind).
func (a *API) rewindJob(w http.ResponseWriter, r *http.Request) {
	var req struct {
		To     uint64 `json:"to"`
		By     string `json:"by"`
		Reason string `json:"reason,omitempty"`
	}
	id, ok := a.decodeJobRequest(w, r, &req)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	res, err := a.Client.Rewind(ctx, id, req.To, client.ControlRequest{By: req.By, Reason: req.Reason})
	if err != nil {
		a.failOrPending(w, r, "rewind", id, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// forkJob starts a fork of a job (client.Fork).
func (a *API) forkJob(w http.ResponseWriter, r *http.Request) {
	var req struct {
		From  uint64                     `json:"from"`
		By    string                     `json:"by"`
		JobID string                     `json:"job_id,omitempty"`
		Set   map[string]json.RawMessage `json:"set,omitempty"`
	}
	id, ok := a.decodeJobRequest(w, r, &req)
	if !ok {
		return
	}
	res, err := a.Client.Fork(r.Context(), id, req.From, client.ForkRequest{JobID: req.JobID, By: req.By, Set: req.Set})
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, res)
}

// migrateJob moves a job to another definition (client.Migrate).
func (a *API) migrateJob(w http.ResponseWriter, r *http.Request) {
	var req client.MigrateRequest
	id, ok := a.decodeJobRequest(w, r, &req)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	v, err := a.Client.Migrate(ctx, id, req)
	if err != nil {
		a.failOrPending(w, r, "migrate", id, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

func (a *API) storeList(w http.ResponseWriter, r *http.Request) {
	es, err := a.Client.Store().Session.List(r.Context(), r.PathValue("ns"))
	if err != nil {
		a.fail(w, r, err)
		return
	}
	if es == nil {
		es = []kv.StoreEntry{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"entries": es})
}

func (a *API) storeGet(w http.ResponseWriter, r *http.Request) {
	e, err := a.Client.Store().Session.Get(r.Context(), r.PathValue("ns"), r.PathValue("key"))
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, e)
}

// storeExpect reads ?revision=N and ?create=true (exclusive).
func storeExpect(r *http.Request) (*uint64, error) {
	q := r.URL.Query()
	rev, create := q.Get("revision"), q.Get("create")
	switch {
	case rev != "" && create != "":
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "give revision or create, not both")
	case create == "true":
		z := uint64(0)
		return &z, nil
	case create != "":
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "create=%q: want true", create)
	case rev != "":
		n, err := strconv.ParseUint(rev, 10, 64)
		if err != nil || n == 0 {
			return nil, schemas.Errorf(schemas.CodeInputInvalid, "revision=%q: want a revision (a positive number)", rev)
		}
		return &n, nil
	}
	return nil, nil
}

func (a *API) storePut(w http.ResponseWriter, r *http.Request) {
	exp, err := storeExpect(r)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	data, err := readBody(w, r)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	if err := schemas.CheckJSONText(data); err != nil {
		a.fail(w, r, fmt.Errorf("request body: %w", err))
		return
	}
	rev, err := a.Client.Store().Session.Put(r.Context(), r.PathValue("ns"), r.PathValue("key"), data, exp)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]uint64{"revision": rev})
}

func (a *API) storeDelete(w http.ResponseWriter, r *http.Request) {
	exp, err := storeExpect(r)
	if err == nil && exp != nil && *exp == 0 {
		err = schemas.Errorf(schemas.CodeInputInvalid, "create is for PUT")
	}
	if err != nil {
		a.fail(w, r, err)
		return
	}
	if err := a.Client.Store().Session.Delete(r.Context(), r.PathValue("ns"), r.PathValue("key"), exp); err != nil {
		a.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// decodeJobRequest reads the job id of the path and the body into req
// (strictly); it answers the error itself and returns false on one.
func (a *API) decodeJobRequest(w http.ResponseWriter, r *http.Request, req any) (string, bool) {
	id := r.PathValue("id")
	if err := client.ValidateJobID(id); err != nil {
		a.fail(w, r, err)
		return "", false
	}
	data, err := readBody(w, r)
	if err != nil {
		a.fail(w, r, err)
		return "", false
	}
	if err := schemas.CheckJSONText(data); err != nil {
		a.fail(w, r, fmt.Errorf("request body: %w", err))
		return "", false
	}
	if err := decodeStrict(data, req); err != nil {
		a.fail(w, r, err)
		return "", false
	}
	return id, true
}

// signalRequest is the body of POST /v1/jobs/{id}/signals/{name}.
type signalRequest struct {
	Data  json.RawMessage `json:"data,omitempty"`
	By    string          `json:"by"`
	ID    string          `json:"id,omitempty"`
	Start *struct {
		Workflow string            `json:"workflow"`
		Input    json.RawMessage   `json:"input,omitempty"`
		Vars     map[string]string `json:"vars,omitempty"`
	} `json:"start,omitempty"`
}

// signalJob sends a named signal to a job (starting it first with start).
func (a *API) signalJob(w http.ResponseWriter, r *http.Request) {
	var req signalRequest
	id, ok := a.decodeJobRequest(w, r, &req)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	sr := client.SignalRequest{Name: r.PathValue("name"), Data: req.Data, By: req.By, ID: req.ID}
	var v *client.JobView
	var rs *schemas.ReceivedSignal
	var err error
	if req.Start != nil {
		if req.Start.Workflow == "" {
			a.fail(w, r, schemas.Errorf(schemas.CodeInputInvalid, "start.workflow is required: the workflow to start the job of"))
			return
		}
		def, err := a.Client.Store().Definitions.Latest(ctx, req.Start.Workflow)
		if err != nil {
			a.fail(w, r, err)
			return
		}
		in := req.Start.Input
		if len(in) == 0 || string(in) == "null" {
			in = json.RawMessage("{}")
		}
		_, v, rs, err = a.Client.SignalWithStart(ctx, def, in, client.StartOptions{JobID: id, Vars: req.Start.Vars}, sr)
		if err != nil {
			a.failOrPending(w, r, "signal", id, err)
			return
		}
	} else if v, rs, err = a.Client.Signal(ctx, id, sr); err != nil {
		a.failOrPending(w, r, "signal", id, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"signal": rs, "job": v})
}

// failOrPending answers err of request op on job id: 202 when no engine
// recorded the request in time (it waits in the job's inbox), else as fail.
func (a *API) failOrPending(w http.ResponseWriter, r *http.Request, op, id string, err error) {
	if (errors.Is(err, client.ErrControlPending) || errors.Is(err, client.ErrCancelPending)) && r.Context().Err() == nil {
		writeJSON(w, http.StatusAccepted, map[string]string{"job_id": id, "message": "no engine recorded the " + op + " within 30s: it waits in the job's inbox, and the next engine to run applies it"})
		return
	}
	a.fail(w, r, err)
}

func (a *API) getHistory(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if err := client.ValidateJobID(id); err != nil {
		a.fail(w, r, err) // 400: no job can have this id
		return
	}
	if _, err := a.Client.Store().Checkpoints.Get(r.Context(), id); err != nil {
		a.fail(w, r, err)
		return
	}
	evs, err := a.Client.History(r.Context(), id)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	if evs == nil {
		evs = []schemas.HistoryEvent{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"events": evs})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false) // "<b>" answers as it was given, not as \u003cb\u003e
	if err := enc.Encode(v); err != nil {
		fmt.Fprintln(w)
	}
}

func (a *API) listEffects(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	if err := checkEnum("state", schemas.EffectState(q.Get("state")), effectStates); err != nil {
		a.fail(w, r, err)
		return
	}
	recs, err := a.Client.Effects(r.Context(), client.EffectFilter{Job: q.Get("job"), State: schemas.EffectState(q.Get("state"))})
	if err != nil {
		a.fail(w, r, err)
		return
	}
	if recs == nil {
		recs = []*schemas.EffectRecord{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"effects": recs})
}

func (a *API) getEffect(w http.ResponseWriter, r *http.Request) {
	rec, err := a.Client.Effect(r.Context(), r.PathValue("key"))
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, rec)
}

// ResolveEffectRequest is the body of POST /v1/effects/resolve. Key and
// happened are required: a body without "happened" is refused rather than
// read as false, which would have the step perform the action again.
type ResolveEffectRequest struct {
	Key string `json:"key"`
	schemas.EffectResolution
}

func (a *API) resolveEffect(w http.ResponseWriter, r *http.Request) {
	data, err := readBody(w, r)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	if err := schemas.CheckJSONText(data); err != nil {
		a.fail(w, r, fmt.Errorf("request body: %w", err))
		return
	}
	var req ResolveEffectRequest
	if err := decodeStrict(data, &req); err != nil {
		a.fail(w, r, err)
		return
	}
	if req.Key == "" {
		a.fail(w, r, badRequest("key is required"))
		return
	}
	// A missing "happened" must not read as false: that would have the
	// step perform an unsafe action again.
	var given struct {
		Happened *bool `json:"happened"`
	}
	if err := json.NewDecoder(bytes.NewReader(data)).Decode(&given); err != nil || given.Happened == nil {
		a.fail(w, r, badRequest("happened is required: true (the effect took place) or false (it did not, and the step will perform it)"))
		return
	}
	rec, err := a.Client.ResolveEffect(r.Context(), req.Key, req.EffectResolution)
	if err != nil {
		a.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, rec)
}
