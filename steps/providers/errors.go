package providers

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Sentinels matched with errors.Is.
var (
	// ErrNoRecording is the cause of the *Error a replay provider returns
	// when its cassette holds no interaction for the request.
	ErrNoRecording = errors.New("no recorded reply")
	// ErrInvalidCassette wraps every validation error from ParseCassette.
	ErrInvalidCassette = errors.New("invalid cassette")
)

// Error is a failed model call, as every provider in this package returns
// it. Retryable says whether the same call may succeed later: true for
// network errors, timeouts, context cancellation, empty replies and HTTP
// 408, 409, 429 and 5xx (including Anthropic's 529 overloaded); false for
// other 4xx (bad request, authentication, permission, unknown model) and
// for mistakes in the request, config or cassette. A retryable error after
// the request was sent means the model may or may not have processed it.
//
// A streamed call (Request.OnText) fails the same way while no reply has
// begun, as the APIs answer errors before the stream starts with their
// status. Once the stream has begun with 200, an error event in it gets
// the StatusCode the API gives its error type (Anthropic's
// overloaded_error is 529, api_error 500, invalid_request_error 400;
// OpenAI's server_error 500, rate_limit_error 429,
// invalid_request_error 400) and is retryable as that status is, or
// StatusCode 0 and retryable for a type without one; a stream that breaks
// off before its end, or that cannot be read, is retryable with
// StatusCode 0. The text already passed to OnText is not taken back.
//
// Message never contains the API key. Unwrap returns the cause, so
// errors.Is(err, context.DeadlineExceeded) holds for a call whose context
// expired.
type Error struct {
	Provider   string        // Anthropic, OpenAI, Replay, or "recorder" for a failed recording
	StatusCode int           // HTTP status; 0 when no response was received
	Retryable  bool          // whether the same call may succeed later
	Message    string        // what went wrong, without the provider name
	RetryAfter time.Duration // the server's Retry-After hint, at most 24h; 0 means none

	err error
}

// Error returns "provider: message".
func (e *Error) Error() string {
	return e.Provider + ": " + e.Message
}

// Unwrap returns the cause, or nil.
func (e *Error) Unwrap() error { return e.err }

// nonRetryable builds an *Error for a call that cannot succeed as made.
func nonRetryable(provider string, cause error, format string, args ...any) *Error {
	return &Error{Provider: provider, Message: fmt.Sprintf(format, args...), err: cause}
}

// emptyReply is the retryable error for a reply without text. refusal is
// the model's refusal text, where the API reports one apart.
func emptyReply(provider, stopReason, refusal string) *Error {
	msg := fmt.Sprintf("empty reply: no text content (stop reason %q)", stopReason)
	if refusal != "" {
		msg += fmt.Sprintf(", refusal %q", refusal)
	}
	return &Error{Provider: provider, Retryable: true, Message: msg}
}

// retryableStatus reports whether an HTTP status is worth retrying.
func retryableStatus(code int) bool {
	switch code {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooManyRequests:
		return true
	}
	return code >= 500
}

// statusError builds the *Error for an error response. errType and apiMsg
// come from the body and may be empty. The SDK's error is not kept as the
// cause: it holds the request, whose headers carry the key.
func statusError(provider, apiKey string, status int, header http.Header, errType, apiMsg string) *Error {
	msg := strconv.Itoa(status)
	if text := http.StatusText(status); text != "" {
		msg += " " + text
	}
	if errType != "" {
		msg += ": " + errType
	}
	if apiMsg != "" {
		msg += ": " + apiMsg
	}
	return &Error{
		Provider:   provider,
		StatusCode: status,
		Retryable:  retryableStatus(status),
		Message:    redact(msg, apiKey),
		RetryAfter: retryAfter(header, time.Now()),
	}
}

// streamedError builds the *Error for an error event in a stream that had
// begun with 200 OK. status is the one the API gives the event's error
// type, 0 when it gives none, which is then retryable as a transport
// failure is.
func streamedError(provider, apiKey string, status int, errType, apiMsg string) *Error {
	const prefix = "error event in the stream: "
	if status == 0 {
		msg := strings.Join(slices.DeleteFunc([]string{errType, apiMsg}, func(s string) bool { return s == "" }), ": ")
		if msg == "" {
			msg = "no message"
		}
		return &Error{Provider: provider, Retryable: true, Message: prefix + redact(msg, apiKey)}
	}
	e := statusError(provider, apiKey, status, nil, errType, apiMsg)
	e.Message = prefix + e.Message
	return e
}

// brokenStream builds the retryable *Error for a stream that ended before
// its end or could not be made into a reply.
func brokenStream(provider, apiKey string, err error) *Error {
	return &Error{Provider: provider, Retryable: true, Message: "broken stream: " + redact(err.Error(), apiKey), err: err}
}

// transportError builds the *Error for a call that got no usable HTTP
// response: a cancelled context, a timeout, a network failure or a reply
// that could not be read. All of them are retryable.
func transportError(ctx context.Context, provider, apiKey string, err error) *Error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		// The caller's context wins over whatever the transport made of it.
		return &Error{Provider: provider, Retryable: true, Message: "call abandoned: " + ctxErr.Error(), err: ctxErr}
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return &Error{Provider: provider, Retryable: true, Message: "request timed out: " + redact(err.Error(), apiKey), err: err}
	}
	return &Error{Provider: provider, Retryable: true, Message: "request failed: " + redact(err.Error(), apiKey), err: err}
}

// redact removes key from s: servers and transports may echo a credential.
func redact(s, key string) string {
	if key == "" {
		return s
	}
	return strings.ReplaceAll(s, key, "[redacted]")
}

// maxRetryAfter caps a server's Retry-After hint.
const maxRetryAfter = 24 * time.Hour

// retryAfter reads Retry-After (RFC 9110 section 10.2.3: seconds or an
// HTTP date) and the retry-after-ms extension some APIs send. It returns 0
// when neither is present and valid, and at most maxRetryAfter.
func retryAfter(h http.Header, now time.Time) time.Duration {
	if ms, err := strconv.ParseFloat(h.Get("Retry-After-Ms"), 64); err == nil && ms > 0 {
		return capRetryAfter(ms / 1000)
	}
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseFloat(v, 64); err == nil {
		return capRetryAfter(secs)
	}
	if at, err := http.ParseTime(v); err == nil {
		return capRetryAfter(at.Sub(now).Seconds())
	}
	return 0
}

func capRetryAfter(secs float64) time.Duration {
	switch {
	case !(secs > 0): // also NaN
		return 0
	case secs >= maxRetryAfter.Seconds():
		return maxRetryAfter
	}
	return time.Duration(secs * float64(time.Second))
}
