package providers

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
)

// CassetteVersion is the cassette format version ParseCassette accepts.
const CassetteVersion = 1

// Cassette holds recorded model replies for the replay provider, in the
// spirit of VCR-style HTTP cassettes but keyed by step rather than by
// request bytes, so a replayed workflow is deterministic and offline. Its
// JSON form:
//
//	{"version": 1, "interactions": [
//	  {"step": "classify", "prompt_sha256": "<hex, optional>", "model": "<optional>",
//	   "replies": [{"text": "positive", "model": "...", "stop_reason": "end_turn",
//	                "usage": {"input_tokens": 12, "output_tokens": 1}}]}]}
type Cassette struct {
	Version      int           `json:"version"`      // CassetteVersion
	Interactions []Interaction `json:"interactions"` // matched in order; the first match answers
}

// Interaction is the recorded replies of one step to one prompt.
type Interaction struct {
	// Step is the step id the interaction answers; required.
	Step string `json:"step"`
	// PromptSHA256 is PromptHash of the recorded request, lowercase hex.
	// Empty matches any prompt.
	PromptSHA256 string `json:"prompt_sha256,omitempty"`
	// Model is the model the replies were recorded from; informational.
	Model string `json:"model,omitempty"`
	// Replies are answered by attempt: attempt n gets Replies[n-1], and
	// attempts past the end get the last one. At least one is required. A
	// reply with empty text replays as the retryable empty-reply error a
	// live provider returns, so a cassette can script a retry.
	Replies []Reply `json:"replies"`
}

// PromptHash identifies a request's prompt for cassette matching: the
// lowercase hex SHA-256 of System + "\n\n" + Prompt.
func PromptHash(req Request) string {
	sum := sha256.Sum256([]byte(req.System + "\n\n" + req.Prompt))
	return hex.EncodeToString(sum[:])
}

// ParseCassette decodes and validates a cassette. It rejects unknown
// fields and trailing data, a version other than CassetteVersion, and an
// interaction without a step, without replies or with a prompt_sha256
// that is not 64 hex digits; the error names the interaction by index and
// wraps ErrInvalidCassette. Hashes are returned lowercased.
func ParseCassette(data []byte) (*Cassette, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var c Cassette
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("%w: decode: %w", ErrInvalidCassette, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: trailing data after the cassette object", ErrInvalidCassette)
	}
	if c.Version != CassetteVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrInvalidCassette, c.Version, CassetteVersion)
	}
	for i := range c.Interactions {
		in := &c.Interactions[i]
		switch {
		case in.Step == "":
			return nil, fmt.Errorf("%w: interaction %d: no step", ErrInvalidCassette, i)
		case len(in.Replies) == 0:
			return nil, fmt.Errorf("%w: interaction %d (step %q): no replies", ErrInvalidCassette, i, in.Step)
		case in.PromptSHA256 != "" && !isSHA256Hex(in.PromptSHA256):
			return nil, fmt.Errorf("%w: interaction %d (step %q): prompt_sha256 %q is not 64 hex digits", ErrInvalidCassette, i, in.Step, in.PromptSHA256)
		}
		in.PromptSHA256 = strings.ToLower(in.PromptSHA256)
	}
	return &c, nil
}

func isSHA256Hex(s string) bool {
	if len(s) != 2*sha256.Size {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

type replayProvider struct {
	interactions []Interaction
}

// NewReplay returns a Provider that answers from c without any network:
// the first interaction whose Step equals req.Step and whose PromptSHA256
// is empty or equals PromptHash(req) answers, with the reply for
// req.Attempt (see Interaction.Replies; an Attempt below 1 counts as 1).
//
// With no matching interaction, Complete returns a non-retryable *Error
// wrapping ErrNoRecording whose message names the step and the prompt
// hash and says how to record a reply. A reply with empty text returns
// the retryable empty-reply *Error. c is copied, so later changes to it
// are not seen; a nil c answers nothing. Safe for concurrent use.
func NewReplay(c *Cassette) Provider {
	p := &replayProvider{}
	if c == nil {
		return p
	}
	p.interactions = make([]Interaction, len(c.Interactions))
	for i, in := range c.Interactions {
		in.Replies = append([]Reply(nil), in.Replies...)
		p.interactions[i] = in
	}
	return p
}

func (p *replayProvider) Complete(ctx context.Context, req Request) (Reply, error) {
	if err := ctx.Err(); err != nil {
		return Reply{}, transportError(ctx, Replay, "", err)
	}
	hash := PromptHash(req)
	otherPrompts := 0
	for i, in := range p.interactions {
		if in.Step != req.Step {
			continue
		}
		if in.PromptSHA256 != "" && !strings.EqualFold(in.PromptSHA256, hash) {
			otherPrompts++
			continue
		}
		if len(in.Replies) == 0 {
			return Reply{}, nonRetryable(Replay, nil, "interaction %d for step %q has no replies", i, in.Step)
		}
		n := min(max(req.Attempt, 1), len(in.Replies))
		reply := in.Replies[n-1]
		if reply.Text == "" {
			return Reply{}, emptyReply(Replay, reply.StopReason, "")
		}
		return reply, nil
	}

	why := "the cassette has no interaction for this step"
	if otherPrompts > 0 {
		why = fmt.Sprintf("the cassette has %d interaction(s) for this step recorded for other prompts, so the prompt or system prompt changed since recording", otherPrompts)
	}
	return Reply{}, nonRetryable(Replay, ErrNoRecording,
		"no recorded reply for step %q with prompt sha256 %s: %s; record one by running the step once through providers.NewRecorder around a live provider, "+
			`or add {"step": %q, "prompt_sha256": %q, "replies": [{"text": "..."}]} to the cassette`,
		req.Step, hash, why, req.Step, hash)
}
