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
//	                "usage": {"input_tokens": 12, "output_tokens": 1}}]},
//	  {"step": "agent", "turn": 1, "prompt_sha256": "<hex, optional>",
//	   "replies": [{"text": "", "stop_reason": "tool_use",
//	                "tool_calls": [{"id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
//	                "usage": {"input_tokens": 40, "output_tokens": 9, "cache_read_input_tokens": 310}}]}]}
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
	// Turn is the conversation turn (Request.Turn, 1-based) the
	// interaction answers; 0 matches any turn, which is what a
	// single-prompt step records.
	Turn int `json:"turn,omitempty"`
	// Model is the model the replies were recorded from; informational.
	Model string `json:"model,omitempty"`
	// Replies are answered by attempt: attempt n gets Replies[n-1], and
	// attempts past the end get the last one. At least one is required. A
	// reply with neither text nor tool calls replays as the retryable
	// empty-reply error a live provider returns, so a cassette can script
	// a retry.
	Replies []Reply `json:"replies"`
}

// PromptHash identifies a request's prompt for cassette matching, as
// lowercase hex SHA-256. Model, sampling, Step, Attempt, Turn and OnText
// are not part of it, so a streamed call matches the recording of an
// unstreamed one and the other way round.
//
// For a single prompt (no Messages) it hashes System + "\n\n" + Prompt.
//
// For a conversation (Messages set) it hashes a canonical JSON of
// {"system", "messages", "tools"}: that object with its members in this
// order, "system" the System string, "messages" the Messages and "tools"
// the Tools (an empty array when there are none), each encoded as
// encoding/json encodes Message, Block and Tool (their JSON tags, in
// declaration order, empty fields omitted, no whitespace, <, > and &
// escaped as \u003c, \u003e and \u0026), with every tool input and input
// schema re-encoded with object keys sorted and numbers as written. So
// the hash changes with any text, tool result, tool call or tool
// definition, and not with the key order or spacing of their JSON.
func PromptHash(req Request) string {
	if len(req.Messages) == 0 {
		sum := sha256.Sum256([]byte(req.System + "\n\n" + req.Prompt))
		return hex.EncodeToString(sum[:])
	}
	sum := sha256.Sum256(canonicalConversation(req))
	return hex.EncodeToString(sum[:])
}

// canonicalConversation is the JSON PromptHash hashes for a conversation.
func canonicalConversation(req Request) []byte {
	msgs := make([]Message, len(req.Messages))
	for i, m := range req.Messages {
		msgs[i] = Message{Role: m.Role, Content: make([]Block, len(m.Content))}
		for j, b := range m.Content {
			b.Input = canonicalJSON(b.Input)
			msgs[i].Content[j] = b
		}
	}
	tools := make([]Tool, len(req.Tools))
	for i, tool := range req.Tools {
		tool.InputSchema = canonicalJSON(tool.InputSchema)
		tools[i] = tool
	}
	data, err := json.Marshal(struct {
		System   string    `json:"system"`
		Messages []Message `json:"messages"`
		Tools    []Tool    `json:"tools"`
	}{req.System, msgs, tools})
	if err != nil {
		// Only invalid RawMessage fails, and canonicalJSON quotes those.
		panic(fmt.Sprintf("providers: canonical conversation: %v", err))
	}
	return data
}

// canonicalJSON re-encodes raw with object keys sorted and numbers kept
// as written. Empty stays empty; JSON that does not parse is returned as
// a JSON string of its bytes, so the hash still covers it.
func canonicalJSON(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err == nil {
		if _, err := dec.Token(); errors.Is(err, io.EOF) {
			if out, err := json.Marshal(v); err == nil {
				return out
			}
		}
	}
	quoted, _ := json.Marshal(string(raw))
	return quoted
}

// ParseCassette decodes and validates a cassette. It rejects unknown
// fields and trailing data, a version other than CassetteVersion, and an
// interaction without a step, without replies, with a negative turn or
// with a prompt_sha256 that is not 64 hex digits, and a tool call without
// an id or a name or whose input is not JSON; the error names the
// interaction by index and wraps ErrInvalidCassette. Hashes are returned
// lowercased.
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
		case in.Turn < 0:
			return nil, fmt.Errorf("%w: interaction %d (step %q): turn %d is negative", ErrInvalidCassette, i, in.Step, in.Turn)
		case in.PromptSHA256 != "" && !isSHA256Hex(in.PromptSHA256):
			return nil, fmt.Errorf("%w: interaction %d (step %q): prompt_sha256 %q is not 64 hex digits", ErrInvalidCassette, i, in.Step, in.PromptSHA256)
		}
		for j, r := range in.Replies {
			for k, tc := range r.ToolCalls {
				switch {
				case tc.ID == "" || tc.Name == "":
					return nil, fmt.Errorf("%w: interaction %d (step %q) reply %d: tool call %d needs an id and a name", ErrInvalidCassette, i, in.Step, j, k)
				case len(tc.Input) > 0 && !json.Valid(tc.Input):
					// Unreachable through Decode, which validates raw JSON; kept for cassettes built in code.
					return nil, fmt.Errorf("%w: interaction %d (step %q) reply %d: tool call %q input is not JSON", ErrInvalidCassette, i, in.Step, j, tc.ID)
				}
			}
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
// the first interaction whose Step equals req.Step, whose Turn is 0 or
// equals req.Turn, and whose PromptSHA256 is empty or equals
// PromptHash(req) answers, with the reply for req.Attempt (see
// Interaction.Replies; an Attempt below 1 counts as 1). Replies are
// returned as recorded, tool calls included; the request is not checked
// as a live provider checks it.
//
// With no matching interaction, Complete returns a non-retryable *Error
// wrapping ErrNoRecording whose message names the step, the turn (for a
// request with a Turn) and the prompt hash, says why nothing matched, and
// gives the interaction to add. A reply with neither text nor tool calls
// returns the retryable empty-reply *Error.
//
// With Request.OnText set, the reply's text is passed to OnText before
// Complete returns, in pieces split after each space (one piece for text
// without a space, none for a reply without text), so that the pieces
// joined are Reply.Text; the Reply is the same. Error replies pass
// nothing.
//
// c is copied, so later changes to it are not seen, and each reply is a
// fresh copy; a nil c answers nothing. Safe for concurrent use.
func NewReplay(c *Cassette) Provider {
	p := &replayProvider{}
	if c == nil {
		return p
	}
	p.interactions = make([]Interaction, len(c.Interactions))
	for i, in := range c.Interactions {
		in.Replies = make([]Reply, len(in.Replies))
		for j, r := range c.Interactions[i].Replies {
			in.Replies[j] = copyReply(r)
		}
		p.interactions[i] = in
	}
	return p
}

func (p *replayProvider) Complete(ctx context.Context, req Request) (Reply, error) {
	if err := ctx.Err(); err != nil {
		return Reply{}, transportError(ctx, Replay, "", err)
	}
	hash := PromptHash(req)
	otherPrompts, otherTurns := 0, 0
	for i, in := range p.interactions {
		if in.Step != req.Step {
			continue
		}
		if in.Turn != 0 && in.Turn != req.Turn {
			otherTurns++
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
		if reply.Text == "" && len(reply.ToolCalls) == 0 {
			return Reply{}, emptyReply(Replay, reply.StopReason, "")
		}
		if req.OnText != nil {
			for _, piece := range textPieces(reply.Text) {
				req.OnText(piece)
			}
		}
		return copyReply(reply), nil
	}

	if req.Turn == 0 {
		why := "the cassette has no interaction for this step"
		if otherPrompts > 0 {
			why = fmt.Sprintf("the cassette has %d interaction(s) for this step recorded for other prompts, so the prompt or system prompt changed since recording", otherPrompts)
		}
		return Reply{}, nonRetryable(Replay, ErrNoRecording,
			"no recorded reply for step %q with prompt sha256 %s: %s; record one by running the step live with WAYMARK_RECORD_CASSETTE=FILE set on the worker (providers.NewRecorder), "+
				`or add {"step": %q, "prompt_sha256": %q, "replies": [{"text": "..."}]} to the cassette`,
			req.Step, hash, why, req.Step, hash)
	}
	why := "the cassette has no interaction for this step"
	switch {
	case otherPrompts > 0:
		why = fmt.Sprintf("the cassette has %d interaction(s) for this step and turn recorded for other conversations, so the system prompt, a message, a tool result or a tool definition changed since recording", otherPrompts)
	case otherTurns > 0:
		why = fmt.Sprintf("the cassette has %d interaction(s) for this step, none for this turn", otherTurns)
	}
	return Reply{}, nonRetryable(Replay, ErrNoRecording,
		"no recorded reply for step %q turn %d with prompt sha256 %s: %s; record one by running the step live with WAYMARK_RECORD_CASSETTE=FILE set on the worker (providers.NewRecorder), "+
			`or add {"step": %q, "turn": %d, "prompt_sha256": %q, "replies": [{"text": "...", "tool_calls": [...]}]} to the cassette`,
		req.Step, req.Turn, hash, why, req.Step, req.Turn, hash)
}

// textPieces splits text after each space, as a replayed reply streams:
// joined, the pieces are text.
func textPieces(text string) []string {
	pieces := strings.SplitAfter(text, " ")
	if pieces[len(pieces)-1] == "" {
		// Text ending in a space, or empty text.
		pieces = pieces[:len(pieces)-1]
	}
	return pieces
}

// copyReply returns r with its own ToolCalls, so callers cannot change
// what a provider holds.
func copyReply(r Reply) Reply {
	if r.ToolCalls != nil {
		calls := make([]ToolCall, len(r.ToolCalls))
		for i, tc := range r.ToolCalls {
			tc.Input = bytes.Clone(tc.Input)
			calls[i] = tc
		}
		r.ToolCalls = calls
	}
	return r
}
