package schemas

import (
	"encoding/json"
	"errors"
	"fmt"
)

// Code names a class of failure. Codes are stable: they are stored in
// checkpoints and history and compared after a round trip through JetStream.
type Code string

// Error codes. Callers branch on them with errors.Is against the sentinels
// below, which match any *Error of the same code.
const (
	CodeDefinitionInvalid Code = "definition_invalid" // a workflow file or definition is malformed
	CodeInputInvalid      Code = "input_invalid"      // job or step input fails its schema
	CodeOutputInvalid     Code = "output_invalid"     // step output fails its schema, or makes state invalid
	CodeReplyNotJSON      Code = "reply_not_json"     // a model reply could not be parsed as JSON
	CodeNotFound          Code = "not_found"          // no such job, definition or record
	CodeConflict          Code = "conflict"           // a compare-and-swap lost to a concurrent writer
	CodeStale             Code = "stale"              // a result for an attempt that is no longer current
	CodeTimeout           Code = "timeout"            // a step ran past its timeout
	CodeTooLarge          Code = "too_large"          // a value exceeds a size limit
	CodeQuarantined       Code = "quarantined"        // a checkpoint failed to decode or validate
	CodeStepFailed        Code = "step_failed"        // a step returned an error (the generic code)
	CodeUnknownKind       Code = "unknown_kind"       // no worker knows the step's kind
	CodeMissingService    Code = "missing_service"    // no worker of the step's pool has a service the step names
	CodeProvider          Code = "provider"           // a model or HTTP provider failed
	CodeCancelled         Code = "cancelled"          // the job or step was cancelled
	CodeAmbiguous         Code = "ambiguous"          // an unsafe effect's outcome is unknown: a person must decide
	CodeNotPerformed      Code = "not_performed"      // the provider refused the call: no effect took place
	CodeDefinitionMissing Code = "definition_missing" // a job's pinned definition cannot be loaded: the job is blocked until it is stored again
	CodeNotAmbiguous      Code = "not_ambiguous"      // an effect resolution for an effect that waits for no decision
	CodeLimitReached      Code = "limit_reached"      // an agent step reached one of its limits (max_turns, max_tool_calls, max_tokens, max_cost)
	CodeApprovalRejected  Code = "approval_rejected"  // a person rejected an approval gate
	CodeApprovalExpired   Code = "approval_expired"   // an approval gate expired before anyone decided
	CodeApprovalScope     Code = "approval_scope"     // the request left the scope its approval allowed: not sent
	CodeWaiting           Code = "waiting"            // the step waits on something outside it (another job's call under the same key): tried again later without using an attempt
)

// Sentinels for errors.Is. Each matches every *Error carrying its code.
var (
	ErrDefinitionInvalid = &Error{Code: CodeDefinitionInvalid}
	ErrInputInvalid      = &Error{Code: CodeInputInvalid}
	ErrOutputInvalid     = &Error{Code: CodeOutputInvalid}
	ErrReplyNotJSON      = &Error{Code: CodeReplyNotJSON}
	ErrNotFound          = &Error{Code: CodeNotFound}
	ErrConflict          = &Error{Code: CodeConflict}
	ErrStale             = &Error{Code: CodeStale}
	ErrTimeout           = &Error{Code: CodeTimeout}
	ErrTooLarge          = &Error{Code: CodeTooLarge}
	ErrQuarantined       = &Error{Code: CodeQuarantined}
	ErrStepFailed        = &Error{Code: CodeStepFailed}
	ErrUnknownKind       = &Error{Code: CodeUnknownKind}
	ErrAmbiguous         = &Error{Code: CodeAmbiguous}
	ErrDefinitionMissing = &Error{Code: CodeDefinitionMissing}
	ErrNotAmbiguous      = &Error{Code: CodeNotAmbiguous}
)

// Error is Waymark's typed error. It serialises to a stable JSON object
// ({"code", "message", ...}) and, decoded again, still matches its sentinel
// through errors.Is, which compares codes only. The idea of persisting
// errors as code plus message comes from DBOS's Go SDK.
type Error struct {
	Code      Code   `json:"code"`
	Message   string `json:"message,omitempty"`
	Job       string `json:"job,omitempty"`
	Step      string `json:"step,omitempty"`
	Attempt   int    `json:"attempt,omitempty"`
	Retryable bool   `json:"retryable,omitempty"` // the step may be attempted again under its retry policy
	// RetryAfterMs is the provider's Retry-After, in milliseconds: the
	// attempt that follows a CodeWaiting error is held this long.
	RetryAfterMs int64 `json:"retry_after_ms,omitempty"`

	cause error
}

// Errorf returns an *Error with the given code and a formatted message. A
// %w verb in format keeps its operand as the cause for errors.Unwrap.
func Errorf(code Code, format string, args ...any) *Error {
	err := fmt.Errorf(format, args...)
	return &Error{Code: code, Message: err.Error(), cause: errors.Unwrap(err)}
}

// Error returns "code: message", prefixed with job/step@attempt when known.
func (e *Error) Error() string {
	where := ""
	if e.Job != "" {
		where = e.Job
		if e.Step != "" {
			where += "/" + e.Step
		}
		if e.Attempt > 0 {
			where += fmt.Sprintf("@%d", e.Attempt)
		}
		where += ": "
	}
	if e.Message == "" {
		return where + string(e.Code)
	}
	return where + string(e.Code) + ": " + e.Message
}

// Is reports whether target is an *Error with the same code.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t != nil && t.Code == e.Code
}

// Unwrap returns the cause, if the error was built with one. Causes are not
// serialised.
func (e *Error) Unwrap() error { return e.cause }

// WithCause returns a copy of e whose Unwrap returns cause.
func (e *Error) WithCause(cause error) *Error {
	c := *e
	c.cause = cause
	return &c
}

// At returns a copy of e annotated with job, step and attempt.
func (e *Error) At(job, step string, attempt int) *Error {
	c := *e
	c.Job, c.Step, c.Attempt = job, step, attempt
	return &c
}

// AsError converts any error into an *Error: an *Error in the chain is
// returned as is, anything else becomes CodeStepFailed with err's message.
// A nil err gives nil.
func AsError(err error) *Error {
	if err == nil {
		return nil
	}
	var we *Error
	if errors.As(err, &we) {
		return we
	}
	return &Error{Code: CodeStepFailed, Message: err.Error(), cause: err}
}

// MarshalJSON encodes the stable fields; the cause is dropped.
func (e *Error) MarshalJSON() ([]byte, error) {
	type plain Error
	return json.Marshal((*plain)(e))
}
