package demo

import (
	"errors"
	"fmt"
	"net/http"
)

// Sentinels for what a caller of this package's Go API branches on.
var (
	// ErrUnknownService: New or Start was given a name not in Names().
	ErrUnknownService = errors.New("demo: unknown service")
	// ErrCorrupt: a data file holds a line that does not decode or breaks
	// the file's sequence. A torn last line (a write cut short) is not
	// corrupt: it was never acknowledged, so it is cut off and logged.
	ErrCorrupt = errors.New("demo: corrupt data file")
	// ErrClosed: the service was closed.
	ErrClosed = errors.New("demo: service closed")
)

// Error codes, the "code" of an error response. They are stable: tests and
// step code may branch on them.
const (
	// CodeInvalidRequest (400): malformed JSON, a wrong type, a missing or
	// bad field, or a bad key. The message names the field or header.
	CodeInvalidRequest = "invalid_request"
	// CodeBodyTooLarge (400): the body exceeds MaxBodyBytes.
	CodeBodyTooLarge = "body_too_large"
	// CodeIdempotencyKeyMissing (400): an idempotent endpoint was called
	// without an Idempotency-Key header.
	CodeIdempotencyKeyMissing = "idempotency_key_missing"
	// CodeIdempotencyKeyReused (422): the key was already used with a
	// different request body. Nothing was done.
	CodeIdempotencyKeyReused = "idempotency_key_reused"
	// CodeIdempotencyKeyInUse (409): an earlier request with the key is still
	// being processed. Retry later with the same key.
	CodeIdempotencyKeyInUse = "idempotency_key_in_use"
	// CodeRecordConflict (409): a record with the key exists with a
	// different body. It was not changed.
	CodeRecordConflict = "record_conflict"
	// CodeNotFound (404): no such route, ticket, charge or record.
	CodeNotFound = "not_found"
	// CodeMethodNotAllowed (405): the route exists for other methods, listed
	// in the Allow header.
	CodeMethodNotAllowed = "method_not_allowed"
	// CodeUnavailable (503): an injected failure (FailNext) or a closed
	// service. Nothing was done.
	CodeUnavailable = "unavailable"
	// CodeInternal (500): the effect could not be persisted. Nothing was
	// done: the write was rolled back and the key left free.
	CodeInternal = "internal"
)

// APIError is the error object of every error response.
type APIError struct {
	Code    string `json:"code"`    // one of the Code* constants
	Message string `json:"message"` // for people; names the field, header or key at fault
}

// Error returns "code: message".
func (e *APIError) Error() string { return e.Code + ": " + e.Message }

// ErrorResponse is the body of every error response:
// {"error": {"code": "...", "message": "..."}}.
type ErrorResponse struct {
	Error APIError `json:"error"`
}

// httpError is an APIError with the status it is sent with.
type httpError struct {
	status int
	APIError
}

func errorf(status int, code, format string, args ...any) *httpError {
	return &httpError{status: status, APIError: APIError{Code: code, Message: fmt.Sprintf(format, args...)}}
}

func badRequest(format string, args ...any) *httpError {
	return errorf(http.StatusBadRequest, CodeInvalidRequest, format, args...)
}

// writeJSON answers status with v encoded as one line of JSON.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := marshal(v)
	if err != nil {
		// Every value sent is built here from plain types; this is a bug.
		writeError(w, errorf(http.StatusInternalServerError, CodeInternal, "encode response: %v", err))
		return
	}
	writeBody(w, status, b)
}

func writeBody(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func writeError(w http.ResponseWriter, e *httpError) {
	b, _ := marshal(ErrorResponse{Error: e.APIError})
	writeBody(w, e.status, b)
}
