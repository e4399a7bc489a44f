package schemas

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"maps"
	"strings"
	"time"
)

// CheckJobInput checks a job input against a workflow's input and state
// schemas (either may be nil) and returns it compacted ({} when empty).
// Errors: ErrInputInvalid, saying what is wrong.
func CheckJobInput(input json.RawMessage, inputSchema, stateSchema *Validator) (json.RawMessage, error) {
	var compact bytes.Buffer
	if t := bytes.TrimSpace(input); len(t) == 0 || string(t) == "null" {
		input = json.RawMessage("{}") // absent or null: no input
	}
	if err := json.Compact(&compact, input); err != nil {
		return nil, Errorf(CodeInputInvalid, "input is not JSON: %v", err)
	}
	input = compact.Bytes()
	if input[0] != '{' {
		return nil, Errorf(CodeInputInvalid, "input must be a JSON object")
	}
	if inputSchema == nil && stateSchema == nil {
		return input, nil
	}
	var doc any
	if err := json.Unmarshal(input, &doc); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && strings.HasPrefix(te.Value, "number") {
			// JSON has no bound on numbers; Waymark reads them as 64-bit
			// floats (state, schemas, templates and conditions alike).
			return nil, Errorf(CodeInputInvalid, "input holds the %s, beyond what a 64-bit float holds (about 1.8e308)", te.Value)
		}
		return nil, Errorf(CodeInputInvalid, "input is not JSON: %v", err)
	}
	if err := inputSchema.Validate(doc); err != nil {
		return nil, Errorf(CodeInputInvalid, "input does not match the workflow's input_schema: %w", err)
	}
	if err := stateSchema.Validate(doc); err != nil {
		return nil, Errorf(CodeInputInvalid, "input, as the initial state, does not match the workflow's state_schema: %w", err)
	}
	return input, nil
}

// NewPendingCheckpoint builds the first checkpoint of a job: status
// pending, the input (already checked and compacted by CheckJobInput) as
// the state, the definition's vars overridden by req.Vars, nothing
// dispatched. cause is the dedup id of the message that creates it.
func NewPendingCheckpoint(def *Definition, req *StartRequest, input json.RawMessage, cause string, now time.Time) *Checkpoint {
	vars := maps.Clone(def.Vars)
	if len(req.Vars) > 0 && vars == nil {
		vars = map[string]string{}
	}
	maps.Copy(vars, req.Vars)
	return &Checkpoint{
		Schema:         CheckpointSchema,
		JobID:          req.JobID,
		Workflow:       def.Name,
		Version:        def.Version,
		DefinitionHash: def.Hash,
		Seq:            1,
		Status:         JobPending,
		InputDigest:    Digest(input),
		State:          input,
		Vars:           vars,
		Steps:          map[string]*StepRecord{},
		Cause:          cause,
		Parent:         req.Parent,
		Caller:         req.Caller,
		Fork:           req.Fork,
		CreatedAt:      now,
		UpdatedAt:      now,
	}
}

// Digest is the hex SHA-256 of b, truncated to 128 bits (32 hex digits):
// enough to tell results apart, short enough to store per step.
func Digest(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:16])
}

// InputDigest digests the compact form of a JSON value, so that white
// space does not count as a difference (key order still does).
func InputDigest(input json.RawMessage) string {
	var b bytes.Buffer
	if err := json.Compact(&b, input); err != nil {
		return Digest(input)
	}
	return Digest(b.Bytes())
}
