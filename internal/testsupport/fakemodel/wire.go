package fakemodel

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"
)

// anthropicWire is the Anthropic Messages API: POST /v1/messages.
var anthropicWire = wire{
	name:   "Anthropic",
	path:   "/v1/messages",
	decode: decodeAnthropic,
	reply:  replyAnthropic,
	stream: streamAnthropic,
	fail:   failAnthropic,
	check:  checkAnthropic,
}

// anthropicBlock is a content block as the Messages API sends it.
type anthropicBlock struct {
	Type         string          `json:"type"`
	Text         string          `json:"text"`
	ID           string          `json:"id"`
	Name         string          `json:"name"`
	Input        json.RawMessage `json:"input"`
	ToolUseID    string          `json:"tool_use_id"`
	Content      json.RawMessage `json:"content"`
	IsError      bool            `json:"is_error"`
	CacheControl *struct {
		Type string `json:"type"`
	} `json:"cache_control"`
}

func (b anthropicBlock) cacheControl() string {
	if b.CacheControl == nil {
		return ""
	}
	return b.CacheControl.Type
}

// anthropicBlocks decodes a content value: a string (one text block) or
// an array of blocks.
func anthropicBlocks(raw json.RawMessage) ([]anthropicBlock, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return []anthropicBlock{{Type: "text", Text: s}}, nil
	}
	var blocks []anthropicBlock
	if err := json.Unmarshal(raw, &blocks); err != nil {
		return nil, fmt.Errorf("content is neither a string nor an array of blocks: %w", err)
	}
	return blocks, nil
}

func decodeAnthropic(body []byte) (Request, error) {
	var in struct {
		Model       string          `json:"model"`
		MaxTokens   int64           `json:"max_tokens"`
		System      json.RawMessage `json:"system"`
		Temperature *float64        `json:"temperature"`
		Stream      bool            `json:"stream"`
		Messages    []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
		Tools []struct {
			Name         string          `json:"name"`
			Description  string          `json:"description"`
			InputSchema  json.RawMessage `json:"input_schema"`
			CacheControl *struct {
				Type string `json:"type"`
			} `json:"cache_control"`
		} `json:"tools"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return Request{}, err
	}
	system, err := anthropicBlocks(in.System)
	if err != nil {
		return Request{}, fmt.Errorf("system: %w", err)
	}
	req := Request{Model: in.Model, MaxTokens: in.MaxTokens, Temperature: in.Temperature, Stream: in.Stream}
	for _, b := range system {
		if b.Type == "text" {
			req.System = joinNonEmpty(req.System, b.Text)
		}
		if cc := b.cacheControl(); cc != "" {
			req.SystemCacheControl = cc
		}
	}
	for i, m := range in.Messages {
		blocks, err := anthropicBlocks(m.Content)
		if err != nil {
			return Request{}, fmt.Errorf("messages[%d]: %w", i, err)
		}
		msg := Message{Role: m.Role}
		for j, b := range blocks {
			out := Block{Type: b.Type, Text: b.Text, ID: b.ID, Name: b.Name, Input: b.Input, ToolUseID: b.ToolUseID, IsError: b.IsError, CacheControl: b.cacheControl()}
			if b.Type == "tool_result" {
				if out.Content, err = text(b.Content); err != nil {
					return Request{}, fmt.Errorf("messages[%d].content[%d]: %w", i, j, err)
				}
			}
			msg.Blocks = append(msg.Blocks, out)
			if m.Role == "user" && b.Type == "text" {
				req.Prompt = joinNonEmpty(req.Prompt, b.Text)
			}
		}
		req.Messages = append(req.Messages, msg)
	}
	for _, t := range in.Tools {
		tool := Tool{Name: t.Name, Description: t.Description, InputSchema: t.InputSchema}
		if t.CacheControl != nil {
			tool.CacheControl = t.CacheControl.Type
		}
		req.Tools = append(req.Tools, tool)
	}
	return req, nil
}

// checkAnthropic refuses what the Messages API refuses about tool use, in
// its words (https://docs.anthropic.com/en/docs/build-with-claude/tool-use).
func checkAnthropic(req Request) string {
	var pending []string // tool_use ids of the previous assistant message
	for i, m := range req.Messages {
		answered := map[string]bool{}
		var uses []string
		for j, b := range m.Blocks {
			switch b.Type {
			case "tool_use", "tool_result":
				if len(req.Tools) == 0 {
					return fmt.Sprintf("messages.%d.content.%d: requests which include `tool_use` or `tool_result` blocks must define tools", i, j)
				}
			}
			switch b.Type {
			case "tool_use":
				uses = append(uses, b.ID)
			case "tool_result":
				if m.Role != "user" || !slices.Contains(pending, b.ToolUseID) {
					return fmt.Sprintf("messages.%d.content.%d: unexpected `tool_use_id` found in `tool_result` blocks: %s. Each `tool_result` block must have a corresponding `tool_use` block in the previous message.", i, j, b.ToolUseID)
				}
				answered[b.ToolUseID] = true
			}
		}
		if missing := unanswered(pending, answered); len(missing) > 0 {
			return fmt.Sprintf("messages.%d: `tool_use` ids were found without `tool_result` blocks immediately after: %s. Each `tool_use` block must have a corresponding `tool_result` block in the next message.", i-1, strings.Join(missing, ", "))
		}
		pending = uses
	}
	if len(pending) > 0 {
		return fmt.Sprintf("messages.%d: `tool_use` ids were found without `tool_result` blocks immediately after: %s. Each `tool_use` block must have a corresponding `tool_result` block in the next message.", len(req.Messages)-1, strings.Join(pending, ", "))
	}
	return ""
}

// unanswered returns the ids in pending that answered lacks, in order.
func unanswered(pending []string, answered map[string]bool) []string {
	var out []string
	for _, id := range pending {
		if !answered[id] {
			out = append(out, id)
		}
	}
	return out
}

func replyAnthropic(w http.ResponseWriter, id int64, req Request, resp Response) {
	content := []map[string]any{}
	if resp.Text != "" {
		content = append(content, map[string]any{"type": "text", "text": resp.Text})
	}
	for _, tc := range anthropicToolUses(id, resp) {
		content = append(content, map[string]any{"type": "tool_use", "id": tc.id, "name": tc.name, "input": json.RawMessage(tc.input)})
	}
	w.Header().Set("request-id", fmt.Sprintf("req_fake_%04d", id))
	writeJSON(w, http.StatusOK, map[string]any{
		"id":            fmt.Sprintf("msg_fake_%04d", id),
		"type":          "message",
		"role":          "assistant",
		"content":       content,
		"model":         req.Model,
		"stop_reason":   anthropicStopReason(resp),
		"stop_sequence": nil,
		"usage":         anthropicUsage(resp, req),
	})
}

// scriptedCall is a scripted tool call as a wire sends it: its id (the
// scripted one or a generated one) and its input or arguments as text.
type scriptedCall struct {
	id, name, input string
}

// anthropicToolUses returns resp's tool calls as tool_use blocks carry
// them, the input compacted as encoding/json writes it into the body.
func anthropicToolUses(id int64, resp Response) []scriptedCall {
	out := make([]scriptedCall, len(resp.ToolCalls))
	for i, tc := range resp.ToolCalls {
		callID := tc.ID
		if callID == "" {
			callID = fmt.Sprintf("toolu_fake_%04d_%d", id, i)
		}
		input := []byte(tc.Input)
		if len(input) == 0 {
			input = []byte("{}")
		}
		// As the JSON body has it; a scripted input that is not JSON is
		// sent as it is, and the client gets to fail on it.
		if compact, err := json.Marshal(json.RawMessage(input)); err == nil {
			input = compact
		}
		out[i] = scriptedCall{id: callID, name: tc.Name, input: string(input)}
	}
	return out
}

// anthropicStopReason returns resp's stop_reason, with the default.
func anthropicStopReason(resp Response) string {
	switch {
	case resp.StopReason != "":
		return resp.StopReason
	case len(resp.ToolCalls) > 0:
		return "tool_use"
	}
	return "end_turn"
}

// anthropicUsage returns the usage object of a reply to req.
func anthropicUsage(resp Response, req Request) map[string]int64 {
	in, out := usage(resp, req)
	return map[string]int64{
		"input_tokens":                in,
		"output_tokens":               out,
		"cache_read_input_tokens":     resp.CacheReadTokens,
		"cache_creation_input_tokens": resp.CacheWriteTokens,
	}
}

func failAnthropic(w http.ResponseWriter, status int, errType, msg string) {
	if errType == "" {
		errType = anthropicErrorType(status)
	}
	writeJSON(w, status, map[string]any{
		"type":  "error",
		"error": map[string]string{"type": errType, "message": msg},
	})
}

// anthropicErrorType maps a status to the error type the Messages API
// documents for it.
func anthropicErrorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "invalid_request_error"
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case 529:
		return "overloaded_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

// openAIWire is the OpenAI Chat Completions API: POST /v1/chat/completions.
var openAIWire = wire{
	name:   "OpenAI",
	path:   "/v1/chat/completions",
	decode: decodeOpenAI,
	reply:  replyOpenAI,
	stream: streamOpenAI,
	fail:   failOpenAI,
	check:  checkOpenAI,
}

func decodeOpenAI(body []byte) (Request, error) {
	var in struct {
		Model               string   `json:"model"`
		MaxTokens           int64    `json:"max_tokens"`
		MaxCompletionTokens int64    `json:"max_completion_tokens"`
		Temperature         *float64 `json:"temperature"`
		Stream              bool     `json:"stream"`
		StreamOptions       *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
		Messages []struct {
			Role       string          `json:"role"`
			Content    json.RawMessage `json:"content"`
			ToolCallID string          `json:"tool_call_id"`
			ToolCalls  []struct {
				ID       string `json:"id"`
				Type     string `json:"type"`
				Function struct {
					Name      string `json:"name"`
					Arguments string `json:"arguments"`
				} `json:"function"`
			} `json:"tool_calls"`
		} `json:"messages"`
		Tools []struct {
			Type     string `json:"type"`
			Function struct {
				Name        string          `json:"name"`
				Description string          `json:"description"`
				Parameters  json.RawMessage `json:"parameters"`
			} `json:"function"`
		} `json:"tools"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return Request{}, err
	}
	req := Request{Model: in.Model, MaxTokens: in.MaxTokens, Temperature: in.Temperature, Stream: in.Stream}
	req.StreamUsage = in.Stream && in.StreamOptions != nil && in.StreamOptions.IncludeUsage
	if in.MaxCompletionTokens != 0 {
		req.MaxTokens = in.MaxCompletionTokens
	}
	for i, m := range in.Messages {
		parts, err := textParts(m.Content)
		if err != nil {
			return Request{}, fmt.Errorf("messages[%d]: %w", i, err)
		}
		t := strings.Join(parts, "\n")
		msg := Message{Role: m.Role}
		switch m.Role {
		case "system", "developer":
			req.System = joinNonEmpty(req.System, t)
		case "user":
			req.Prompt = joinNonEmpty(req.Prompt, t)
		}
		if m.Role == "tool" {
			msg.Blocks = []Block{{Type: "tool_result", ToolUseID: m.ToolCallID, Content: t}}
		} else {
			for _, p := range parts {
				msg.Blocks = append(msg.Blocks, Block{Type: "text", Text: p})
			}
		}
		for _, tc := range m.ToolCalls {
			input := json.RawMessage(tc.Function.Arguments)
			if !json.Valid(input) {
				input, _ = json.Marshal(tc.Function.Arguments)
			}
			msg.Blocks = append(msg.Blocks, Block{Type: "tool_use", ID: tc.ID, Name: tc.Function.Name, Input: input})
		}
		req.Messages = append(req.Messages, msg)
	}
	for _, t := range in.Tools {
		req.Tools = append(req.Tools, Tool{Name: t.Function.Name, Description: t.Function.Description, InputSchema: t.Function.Parameters})
	}
	return req, nil
}

// textParts returns the texts of a chat content value: a string, or an
// array of parts of which the text parts count.
func textParts(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return []string{s}, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return nil, fmt.Errorf("content is neither a string nor an array of parts: %w", err)
	}
	var out []string
	for _, p := range parts {
		if p.Type == "text" {
			out = append(out, p.Text)
		}
	}
	return out, nil
}

// checkOpenAI refuses what Chat Completions refuses about tool calls, in
// its words (https://platform.openai.com/docs/guides/function-calling).
func checkOpenAI(req Request) string {
	var pending []string // tool call ids of the last assistant message still unanswered
	answered := map[string]bool{}
	for i, m := range req.Messages {
		if m.Role == "tool" {
			id := m.Blocks[0].ToolUseID
			if !slices.Contains(pending, id) || answered[id] {
				return fmt.Sprintf("Invalid parameter: messages[%d]: messages with role 'tool' must be a response to a preceding message with 'tool_calls' (tool_call_id %q).", i, id)
			}
			answered[id] = true
			continue
		}
		if missing := unanswered(pending, answered); len(missing) > 0 {
			return fmt.Sprintf("An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: %s", strings.Join(missing, ", "))
		}
		pending, answered = nil, map[string]bool{}
		for _, b := range m.Blocks {
			if b.Type == "tool_use" {
				pending = append(pending, b.ID)
			}
		}
	}
	if missing := unanswered(pending, answered); len(missing) > 0 {
		return fmt.Sprintf("An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: %s", strings.Join(missing, ", "))
	}
	return ""
}

func replyOpenAI(w http.ResponseWriter, id int64, req Request, resp Response) {
	var content any // null when there is no text, as the API sends it
	if resp.Text != "" {
		content = resp.Text
	}
	message := map[string]any{"role": "assistant", "content": content, "refusal": nil}
	if calls := openAIToolCalls(id, resp); len(calls) > 0 {
		out := make([]map[string]any, len(calls))
		for i, tc := range calls {
			out[i] = map[string]any{"id": tc.id, "type": "function", "function": map[string]string{"name": tc.name, "arguments": tc.input}}
		}
		message["tool_calls"] = out
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id":      fmt.Sprintf("chatcmpl-fake-%04d", id),
		"object":  "chat.completion",
		"created": time.Now().Unix(),
		"model":   req.Model,
		"choices": []map[string]any{{
			"index":         0,
			"message":       message,
			"logprobs":      nil,
			"finish_reason": openAIFinishReason(resp),
		}},
		"usage": openAIUsage(resp, req),
	})
}

// openAIToolCalls returns resp's tool calls as an assistant message's
// tool_calls carry them, input the arguments string.
func openAIToolCalls(id int64, resp Response) []scriptedCall {
	out := make([]scriptedCall, len(resp.ToolCalls))
	for i, tc := range resp.ToolCalls {
		callID := tc.ID
		if callID == "" {
			callID = fmt.Sprintf("call_fake_%04d_%d", id, i)
		}
		args := tc.Arguments
		if args == "" {
			args = string(tc.Input)
		}
		if args == "" {
			args = "{}"
		}
		out[i] = scriptedCall{id: callID, name: tc.Name, input: args}
	}
	return out
}

// openAIFinishReason returns resp's finish_reason, with the default.
func openAIFinishReason(resp Response) string {
	switch {
	case resp.StopReason != "":
		return resp.StopReason
	case len(resp.ToolCalls) > 0:
		return "tool_calls"
	}
	return "stop"
}

// openAIUsage returns the usage object of a reply to req.
func openAIUsage(resp Response, req Request) map[string]any {
	in, out := usage(resp, req)
	u := map[string]any{"prompt_tokens": in, "completion_tokens": out, "total_tokens": in + out}
	if resp.CacheReadTokens != 0 || resp.CacheWriteTokens != 0 {
		details := map[string]int64{"cached_tokens": resp.CacheReadTokens}
		if resp.CacheWriteTokens != 0 {
			details["cache_write_tokens"] = resp.CacheWriteTokens
		}
		u["prompt_tokens_details"] = details
	}
	return u
}

func failOpenAI(w http.ResponseWriter, status int, errType, msg string) {
	code := openAIErrorCode(status)
	if errType == "" {
		errType = openAIErrorType(status)
	}
	writeJSON(w, status, map[string]any{
		"error": map[string]any{"message": msg, "type": errType, "param": nil, "code": code},
	})
}

func openAIErrorType(status int) string {
	switch {
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status >= 500:
		return "server_error"
	}
	return "invalid_request_error"
}

// openAIErrorCode returns the code the API sends with a status, or nil.
func openAIErrorCode(status int) any {
	switch status {
	case http.StatusUnauthorized:
		return "invalid_api_key"
	case http.StatusNotFound:
		return "model_not_found"
	case http.StatusTooManyRequests:
		return "rate_limit_exceeded"
	}
	return nil
}
