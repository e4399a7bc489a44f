package demo

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxBodyBytes is the largest request body a service reads (1 MiB). A
// larger one gets 400 with CodeBodyTooLarge.
const MaxBodyBytes = 1 << 20

// MaxKeyBytes is the longest idempotency, effect or record key, in bytes
// (Stripe's limit).
const MaxKeyBytes = 255

// Header names.
const (
	// IdempotencyKeyHeader carries the key of one logical action (IETF
	// httpapi draft "The Idempotency-Key HTTP Header Field"). Both the bare
	// form (Stripe's) and the draft's quoted Structured Field string are
	// accepted; "abc" and abc are the same key.
	IdempotencyKeyHeader = "Idempotency-Key"
	// ReplayedHeader is "true" on an answer replayed from an earlier request
	// with the same key (Stripe's header).
	ReplayedHeader = "Idempotent-Replayed"
	// EffectKeyHeader names the logical action of a mail call for counting
	// only, when no Idempotency-Key is sent. mail never deduplicates by it.
	EffectKeyHeader = "X-Waymark-Effect-Key"
)

// noKey is the key calls and effects are counted under when a request has
// none.
const noKey = "-"

// readBody reads at most MaxBodyBytes of r's body.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, *httpError) {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return nil, errorf(http.StatusBadRequest, CodeBodyTooLarge, "request body exceeds %d bytes", MaxBodyBytes)
		}
		return nil, badRequest("read request body: %v", err)
	}
	return data, nil
}

// decodeObject decodes data, which must be exactly one JSON object, into
// the struct v, rejecting unknown fields. Errors name the field.
func decodeObject(data []byte, v any) *httpError {
	if len(bytes.TrimSpace(data)) == 0 {
		return badRequest("request body is empty; want a JSON object")
	}
	if k := jsonKind(data); k != "object" && k != "invalid" {
		return badRequest("request body is a JSON %s; want an object", k)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return decodeError(err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return badRequest("unexpected data after the JSON object at byte %d", dec.InputOffset())
	}
	return nil
}

func decodeError(err error) *httpError {
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syntax):
		return badRequest("malformed JSON at byte %d: %s", syntax.Offset, strings.TrimPrefix(syntax.Error(), "json: "))
	case errors.As(err, &typ):
		field := typ.Field
		if field == "" {
			field = "request body"
		}
		return badRequest("field %q is a JSON %s; want %s", field, typ.Value, jsonTypeName(typ.Type))
	case errors.Is(err, io.ErrUnexpectedEOF):
		return badRequest("malformed JSON: unexpected end of input")
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return badRequest("unknown field %s", strings.TrimPrefix(err.Error(), "json: unknown field "))
	}
	return badRequest("malformed JSON: %s", strings.TrimPrefix(err.Error(), "json: "))
}

// jsonTypeName names the JSON type a Go type decodes from.
func jsonTypeName(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Slice, reflect.Array:
		return "an array"
	}
	return "an object"
}

// jsonKind names the JSON type of the value data starts with: object, array,
// string, number, boolean or null ("invalid" when it starts with none).
func jsonKind(data []byte) string {
	data = bytes.TrimLeft(data, " \t\r\n")
	if len(data) == 0 {
		return "invalid"
	}
	switch c := data[0]; {
	case c == '{':
		return "object"
	case c == '[':
		return "array"
	case c == '"':
		return "string"
	case c == 't' || c == 'f':
		return "boolean"
	case c == 'n':
		return "null"
	case c == '-' || (c >= '0' && c <= '9'):
		return "number"
	}
	return "invalid"
}

// canonical re-encodes one JSON value in a canonical form: no insignificant
// white space, object keys sorted, strings re-escaped the same way, numbers
// kept as written (so 1 and 1.0 differ). Two bodies a client would call the
// same request get the same bytes.
func canonical(data []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("unexpected data after the JSON value at byte %d", dec.InputOffset())
	}
	return marshal(v)
}

// fingerprint is "sha256:" and the hex SHA-256 of a canonical body.
func fingerprint(canon []byte) string {
	sum := sha256.Sum256(canon)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// marshal encodes v as JSON without HTML escaping and with no trailing
// newline.
func marshal(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// checkKey validates a key named what (for messages): 1 to MaxKeyBytes
// bytes of UTF-8 with no control characters.
func checkKey(what, key string) *httpError {
	switch {
	case key == "":
		return badRequest("%s is empty", what)
	case len(key) > MaxKeyBytes:
		return badRequest("%s is %d bytes; the limit is %d", what, len(key), MaxKeyBytes)
	case !utf8.ValidString(key):
		return badRequest("%s is not valid UTF-8", what)
	case strings.IndexFunc(key, unicode.IsControl) >= 0:
		return badRequest("%s contains a control character", what)
	}
	return nil
}

// idempotencyKey returns r's Idempotency-Key: present once, unquoted when
// sent as a Structured Field string, and valid.
func idempotencyKey(r *http.Request) (string, *httpError) {
	vals := r.Header.Values(IdempotencyKeyHeader)
	switch {
	case len(vals) == 0:
		return "", errorf(http.StatusBadRequest, CodeIdempotencyKeyMissing,
			"header %s is required on this endpoint", IdempotencyKeyHeader)
	case len(vals) > 1:
		return "", badRequest("header %s appears %d times; send it once", IdempotencyKeyHeader, len(vals))
	}
	key := unquote(strings.TrimSpace(vals[0]))
	if err := checkKey("header "+IdempotencyKeyHeader, key); err != nil {
		return "", err
	}
	return key, nil
}

// unquote undoes the Structured Field string form ("...", with \" and \\
// escapes); anything else is returned as is.
func unquote(s string) string {
	if len(s) < 2 || s[0] != '"' || s[len(s)-1] != '"' {
		return s
	}
	if u, err := strconv.Unquote(s); err == nil {
		return u
	}
	return s
}
