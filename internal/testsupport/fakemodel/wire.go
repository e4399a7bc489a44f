package fakemodel

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// anthropicWire is the Anthropic Messages API: POST /v1/messages.
var anthropicWire = wire{
	name:   "Anthropic",
	path:   "/v1/messages",
	decode: decodeAnthropic,
	reply:  replyAnthropic,
	fail:   failAnthropic,
}

func decodeAnthropic(body []byte) (Request, error) {
	var in struct {
		Model       string          `json:"model"`
		MaxTokens   int64           `json:"max_tokens"`
		System      json.RawMessage `json:"system"`
		Temperature *float64        `json:"temperature"`
		Messages    []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return Request{}, err
	}
	system, err := text(in.System)
	if err != nil {
		return Request{}, fmt.Errorf("system: %w", err)
	}
	req := Request{Model: in.Model, System: system, MaxTokens: in.MaxTokens, Temperature: in.Temperature}
	for i, m := range in.Messages {
		t, err := text(m.Content)
		if err != nil {
			return Request{}, fmt.Errorf("messages[%d]: %w", i, err)
		}
		if m.Role == "user" {
			req.Prompt = joinNonEmpty(req.Prompt, t)
		}
	}
	return req, nil
}

func replyAnthropic(w http.ResponseWriter, id int64, req Request, resp Response) {
	type block struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	content := []block{}
	if resp.Text != "" {
		content = append(content, block{Type: "text", Text: resp.Text})
	}
	stop := resp.StopReason
	if stop == "" {
		stop = "end_turn"
	}
	in, out := usage(resp, req)
	w.Header().Set("request-id", fmt.Sprintf("req_fake_%04d", id))
	writeJSON(w, http.StatusOK, map[string]any{
		"id":            fmt.Sprintf("msg_fake_%04d", id),
		"type":          "message",
		"role":          "assistant",
		"content":       content,
		"model":         req.Model,
		"stop_reason":   stop,
		"stop_sequence": nil,
		"usage":         map[string]int64{"input_tokens": in, "output_tokens": out},
	})
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
	fail:   failOpenAI,
}

func decodeOpenAI(body []byte) (Request, error) {
	var in struct {
		Model               string   `json:"model"`
		MaxTokens           int64    `json:"max_tokens"`
		MaxCompletionTokens int64    `json:"max_completion_tokens"`
		Temperature         *float64 `json:"temperature"`
		Messages            []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return Request{}, err
	}
	req := Request{Model: in.Model, MaxTokens: in.MaxTokens, Temperature: in.Temperature}
	if in.MaxCompletionTokens != 0 {
		req.MaxTokens = in.MaxCompletionTokens
	}
	for i, m := range in.Messages {
		t, err := text(m.Content)
		if err != nil {
			return Request{}, fmt.Errorf("messages[%d]: %w", i, err)
		}
		switch m.Role {
		case "system", "developer":
			req.System = joinNonEmpty(req.System, t)
		case "user":
			req.Prompt = joinNonEmpty(req.Prompt, t)
		}
	}
	return req, nil
}

func replyOpenAI(w http.ResponseWriter, id int64, req Request, resp Response) {
	finish := resp.StopReason
	if finish == "" {
		finish = "stop"
	}
	var content any // null when there is no text, as the API sends it
	if resp.Text != "" {
		content = resp.Text
	}
	in, out := usage(resp, req)
	writeJSON(w, http.StatusOK, map[string]any{
		"id":      fmt.Sprintf("chatcmpl-fake-%04d", id),
		"object":  "chat.completion",
		"created": time.Now().Unix(),
		"model":   req.Model,
		"choices": []map[string]any{{
			"index":         0,
			"message":       map[string]any{"role": "assistant", "content": content, "refusal": nil},
			"logprobs":      nil,
			"finish_reason": finish,
		}},
		"usage": map[string]int64{"prompt_tokens": in, "completion_tokens": out, "total_tokens": in + out},
	})
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
