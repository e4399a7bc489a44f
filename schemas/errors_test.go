package schemas_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

var sentinels = map[schemas.Code]*schemas.Error{
	schemas.CodeDefinitionInvalid: schemas.ErrDefinitionInvalid,
	schemas.CodeInputInvalid:      schemas.ErrInputInvalid,
	schemas.CodeOutputInvalid:     schemas.ErrOutputInvalid,
	schemas.CodeReplyNotJSON:      schemas.ErrReplyNotJSON,
	schemas.CodeNotFound:          schemas.ErrNotFound,
	schemas.CodeConflict:          schemas.ErrConflict,
	schemas.CodeStale:             schemas.ErrStale,
	schemas.CodeTimeout:           schemas.ErrTimeout,
	schemas.CodeTooLarge:          schemas.ErrTooLarge,
	schemas.CodeQuarantined:       schemas.ErrQuarantined,
	schemas.CodeStepFailed:        schemas.ErrStepFailed,
	schemas.CodeUnknownKind:       schemas.ErrUnknownKind,
}

func TestErrorIsMatchesByCode(t *testing.T) {
	t.Parallel()
	for code, sentinel := range sentinels {
		err := schemas.Errorf(code, "something about %s", "x").At("job-1", "step", 2)
		for other, s := range sentinels {
			if got := errors.Is(err, s); got != (other == code) {
				t.Errorf("errors.Is(%s error, %s sentinel) = %v", code, other, got)
			}
		}
		if !errors.Is(fmt.Errorf("wrapped: %w", err), sentinel) {
			t.Errorf("a wrapped %s error does not match its sentinel", code)
		}
	}
	if errors.Is(errors.New("conflict"), schemas.ErrConflict) {
		t.Error("a plain error matched ErrConflict")
	}
	var typedNil *schemas.Error
	if errors.Is(schemas.ErrConflict, typedNil) {
		t.Error("an error matched a nil *Error")
	}
}

func TestErrorJSONRoundTrip(t *testing.T) {
	t.Parallel()
	cause := io.ErrUnexpectedEOF
	orig := (&schemas.Error{Code: schemas.CodeTimeout, Message: "step ran 31s; timeout 30s", Retryable: true}).
		WithCause(cause).At("job-7", "fetch", 3)
	b, err := json.Marshal(orig)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"code":"timeout","message":"step ran 31s; timeout 30s","job":"job-7","step":"fetch","attempt":3,"retryable":true}`
	if string(b) != want {
		t.Errorf("Marshal = %s, want %s", b, want)
	}
	var back schemas.Error
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Code != orig.Code || back.Message != orig.Message || back.Job != orig.Job || back.Step != orig.Step || back.Attempt != orig.Attempt || back.Retryable != orig.Retryable {
		t.Errorf("round trip = %+v, want %+v", back, *orig)
	}
	if !errors.Is(&back, schemas.ErrTimeout) {
		t.Error("decoded error does not match ErrTimeout")
	}
	if back.Unwrap() != nil {
		t.Errorf("cause survived serialisation: %v", back.Unwrap())
	}
	if back.Error() != orig.Error() {
		t.Errorf("Error() = %q after the round trip, want %q", back.Error(), orig.Error())
	}

	// As a field of a stored record, value or pointer, the encoding is the same.
	type record struct {
		Err  *schemas.Error `json:"err"`
		Last schemas.Error  `json:"last"`
	}
	b, err = json.Marshal(record{Err: orig, Last: *orig})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"err":` + want + `,"last":` + want + `}`; string(b) != want {
		t.Errorf("Marshal(record) = %s, want %s", b, want)
	}
	var r record
	if err := json.Unmarshal(b, &r); err != nil || !errors.Is(r.Err, schemas.ErrTimeout) || !errors.Is(&r.Last, schemas.ErrTimeout) {
		t.Errorf("record round trip: %+v, %v", r, err)
	}

	// Omitted fields stay omitted: the minimal form is {code}.
	if b, _ := json.Marshal(schemas.ErrConflict); string(b) != `{"code":"conflict"}` {
		t.Errorf("Marshal(ErrConflict) = %s", b)
	}
}

func TestErrorfKeepsCause(t *testing.T) {
	t.Parallel()
	cause := errors.New("connection reset")
	err := schemas.Errorf(schemas.CodeStepFailed, "call %s: %w", "payments", cause)
	if err.Message != "call payments: connection reset" {
		t.Errorf("Message = %q", err.Message)
	}
	if errors.Unwrap(err) != cause || !errors.Is(err, cause) {
		t.Errorf("Unwrap = %v, want the cause", errors.Unwrap(err))
	}
	if plain := schemas.Errorf(schemas.CodeStepFailed, "no cause %v", cause); errors.Unwrap(plain) != nil {
		t.Errorf("%%v kept a cause: %v", errors.Unwrap(plain))
	}
	// A cause that is itself a typed error is still found through the chain.
	outer := schemas.Errorf(schemas.CodeStepFailed, "retry: %w", schemas.Errorf(schemas.CodeConflict, "lost"))
	if !errors.Is(outer, schemas.ErrConflict) || !errors.Is(outer, schemas.ErrStepFailed) {
		t.Error("a nested typed error is not found by errors.Is")
	}
}

func TestErrorAtAndText(t *testing.T) {
	t.Parallel()
	base := schemas.Errorf(schemas.CodeOutputInvalid, "at /x: expected string")
	at := base.At("job-1", "classify", 2)
	if base.Job != "" || base.Step != "" || base.Attempt != 0 {
		t.Errorf("At modified its receiver: %+v", base)
	}
	if at.Code != base.Code || at.Message != base.Message {
		t.Errorf("At lost code or message: %+v", at)
	}
	rows := []struct {
		err  *schemas.Error
		want string
	}{
		{at, "job-1/classify@2: output_invalid: at /x: expected string"},
		{base, "output_invalid: at /x: expected string"},
		{schemas.ErrNotFound, "not_found"},
		{schemas.ErrConflict.At("job-2", "", 0), "job-2: conflict"},
		{schemas.ErrConflict.At("job-2", "s", 0), "job-2/s: conflict"},
		{schemas.ErrTooLarge.At("job-2", "", 4), "job-2@4: too_large"},
		{schemas.ErrTimeout.At("", "s", 4), "timeout"},
	}
	for _, r := range rows {
		if got := r.err.Error(); got != r.want {
			t.Errorf("Error() = %q, want %q", got, r.want)
		}
	}
}

func TestAsError(t *testing.T) {
	t.Parallel()
	if schemas.AsError(nil) != nil {
		t.Error("AsError(nil) != nil")
	}
	typed := schemas.Errorf(schemas.CodeConflict, "x")
	if got := schemas.AsError(fmt.Errorf("wrap: %w", typed)); got != typed {
		t.Errorf("AsError did not find the typed error: %v", got)
	}
	plain := errors.New("disk full")
	got := schemas.AsError(plain)
	if got.Code != schemas.CodeStepFailed || got.Message != "disk full" || !errors.Is(got, plain) {
		t.Errorf("AsError(plain) = %+v", got)
	}
}

func TestDefinitionErrorText(t *testing.T) {
	t.Parallel()
	err := &schemas.DefinitionError{File: "wf.yaml", Problems: []schemas.LocatedProblem{
		{Problem: schemas.Problem{Message: "file is empty"}},
		{Problem: schemas.Problem{Path: "/steps/1/kind", Message: "unknown kind"}, Line: 7, Column: 11},
		{Problem: schemas.Problem{Path: "/name", Message: "bad"}, Line: 2},
	}}
	want := "wf.yaml: invalid workflow definition (3 problems)\n" +
		"  wf.yaml: file is empty\n" +
		"  wf.yaml:7:11: steps[1].kind: unknown kind\n" +
		"  wf.yaml:2: name: bad"
	if err.Error() != want {
		t.Errorf("Error() =\n%s\nwant\n%s", err, want)
	}
	one := &schemas.DefinitionError{File: "x", Problems: err.Problems[:1]}
	if got := one.Error(); got != "x: invalid workflow definition (1 problem)\n  x: file is empty" {
		t.Errorf("Error() = %q", got)
	}
	if !errors.Is(err, schemas.ErrDefinitionInvalid) || errors.Is(err, schemas.ErrInputInvalid) {
		t.Error("DefinitionError matches the wrong sentinels")
	}
}
