package providers

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
)

// defaultMaxTokens is the reply cap when Request.MaxTokens is 0.
const defaultMaxTokens = 1024

// checkConfig reports a Config a live provider cannot work with. It runs
// once, in the constructor; Complete returns what it found.
func checkConfig(provider string, cfg Config) *Error {
	if cfg.BaseURL == "" {
		if cfg.APIKey == "" {
			return nonRetryable(provider, nil, "Config.APIKey is empty: the public API needs a key")
		}
		return nil
	}
	u, err := url.Parse(cfg.BaseURL)
	if err != nil {
		// url.Error quotes the URL, which may hold a password: keep its reason only.
		var urlErr *url.Error
		if errors.As(err, &urlErr) {
			err = urlErr.Err
		}
		return nonRetryable(provider, nil, "Config.BaseURL is not a URL: %v", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nonRetryable(provider, nil, "Config.BaseURL %q: want an http or https URL with a host", u.Redacted())
	}
	return nil
}

// checkRequest reports a Request no live provider can send (see
// Request's doc for the rules), and returns its reply cap with the
// default applied.
func checkRequest(provider string, req Request) (maxTokens int64, err error) {
	switch {
	case req.Model == "":
		return 0, nonRetryable(provider, nil, "request for step %q has no model", req.Step)
	case req.Prompt != "" && len(req.Messages) > 0:
		return 0, nonRetryable(provider, nil, "request for step %q has both a prompt and messages: set Prompt for one user turn or Messages for a conversation, not both", req.Step)
	case req.Prompt == "" && len(req.Messages) == 0:
		return 0, nonRetryable(provider, nil, "request for step %q has an empty prompt and no messages", req.Step)
	case req.MaxTokens < 0:
		return 0, nonRetryable(provider, nil, "request for step %q: max tokens %d is negative", req.Step, req.MaxTokens)
	}
	if err := checkConversation(req); err != nil {
		return 0, nonRetryable(provider, nil, "request for step %q turn %d: %v", req.Step, req.Turn, err)
	}
	if req.MaxTokens == 0 {
		return defaultMaxTokens, nil
	}
	return int64(req.MaxTokens), nil
}

// checkConversation reports what is wrong with req's Messages and Tools,
// or nil. Indexes in messages are 0-based, as the APIs' own errors count.
func checkConversation(req Request) error {
	names := make(map[string]bool, len(req.Tools))
	for i, tool := range req.Tools {
		switch {
		case tool.Name == "":
			return fmt.Errorf("tools[%d] has no name", i)
		case names[tool.Name]:
			return fmt.Errorf("tools[%d]: tool %q is declared twice", i, tool.Name)
		case len(tool.InputSchema) > 0 && !isJSONObject(tool.InputSchema):
			return fmt.Errorf("tools[%d] (%q): input schema is not a JSON object", i, tool.Name)
		}
		names[tool.Name] = true
	}

	// pending holds the tool_use ids of the previous assistant message
	// still waiting for their tool_result.
	var pending []string
	seen := make(map[string]bool)
	for i, m := range req.Messages {
		if m.Role != RoleUser && m.Role != RoleAssistant {
			return fmt.Errorf("messages[%d]: role %q, want %q or %q", i, m.Role, RoleUser, RoleAssistant)
		}
		if len(m.Content) == 0 {
			return fmt.Errorf("messages[%d] (%s) has no content blocks", i, m.Role)
		}
		answered := make(map[string]bool)
		var uses []string
		for j, b := range m.Content {
			if err := checkBlock(m.Role, b); err != nil {
				return fmt.Errorf("messages[%d].content[%d]: %w", i, j, err)
			}
			switch b.Type {
			case BlockToolUse:
				if seen[b.ToolUseID] {
					return fmt.Errorf("messages[%d].content[%d]: tool_use id %q is used twice in the conversation", i, j, b.ToolUseID)
				}
				seen[b.ToolUseID] = true
				uses = append(uses, b.ToolUseID)
			case BlockToolResult:
				if !slices.Contains(pending, b.ToolUseID) {
					return fmt.Errorf("messages[%d].content[%d]: tool_result for %q answers no tool_use of the assistant message before it", i, j, b.ToolUseID)
				}
				if answered[b.ToolUseID] {
					return fmt.Errorf("messages[%d].content[%d]: tool_use %q is answered twice", i, j, b.ToolUseID)
				}
				answered[b.ToolUseID] = true
			}
		}
		for _, id := range pending {
			if !answered[id] {
				return fmt.Errorf("messages[%d]: tool_use %q of messages[%d] has no tool_result here; every tool call must be answered in the next user message", i, id, i-1)
			}
		}
		pending = uses
	}
	if len(pending) > 0 {
		return fmt.Errorf("messages[%d]: tool_use %q is never answered; end the conversation with a user message holding its tool_result", len(req.Messages)-1, pending[0])
	}
	return nil
}

// checkBlock reports a block that is not valid for its type and role.
func checkBlock(role string, b Block) error {
	switch b.Type {
	case BlockText:
		if b.Text == "" {
			return errors.New("empty text block")
		}
		if b.ToolUseID != "" || b.Name != "" || b.Input != nil || b.Content != "" || b.IsError {
			return errors.New("text block has tool fields set")
		}
	case BlockToolUse:
		switch {
		case role != RoleAssistant:
			return errors.New("tool_use block in a user message; tool calls come from the assistant")
		case b.ToolUseID == "":
			return errors.New("tool_use block has no ToolUseID")
		case b.Name == "":
			return fmt.Errorf("tool_use %q has no tool name", b.ToolUseID)
		case len(b.Input) > 0 && !json.Valid(b.Input):
			return fmt.Errorf("tool_use %q: input is not valid JSON", b.ToolUseID)
		case b.Text != "" || b.Content != "" || b.IsError:
			return fmt.Errorf("tool_use %q has text or result fields set", b.ToolUseID)
		}
	case BlockToolResult:
		switch {
		case role != RoleUser:
			return errors.New("tool_result block in an assistant message; tool results go in the next user message")
		case b.ToolUseID == "":
			return errors.New("tool_result block has no ToolUseID naming the call it answers")
		case b.Text != "" || b.Name != "" || b.Input != nil:
			return fmt.Errorf("tool_result for %q has text or tool_use fields set (its result goes in Content)", b.ToolUseID)
		}
	default:
		return fmt.Errorf("block type %q, want %q, %q or %q", b.Type, BlockText, BlockToolUse, BlockToolResult)
	}
	return nil
}

// isJSONObject reports whether raw is one JSON object.
func isJSONObject(raw json.RawMessage) bool {
	var obj map[string]json.RawMessage
	return json.Unmarshal(raw, &obj) == nil && obj != nil
}

// toolInput returns a tool_use block's input to send: {} when empty.
func toolInput(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 {
		return json.RawMessage("{}")
	}
	return raw
}
