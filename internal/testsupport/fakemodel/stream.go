package fakemodel

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"
)

// argumentPiece is the most bytes of tool input one streamed delta
// carries, so that a short input still arrives in several pieces.
const argumentPiece = 8

// sse writes server-sent events
// (https://html.spec.whatwg.org/multipage/server-sent-events.html),
// flushing each one so the client sees it as it is written. Write errors
// are dropped: the client may be gone, and there is no one to tell.
type sse struct {
	w http.ResponseWriter
	f http.Flusher
}

// startSSE sends the 200 and the event-stream headers.
func startSSE(w http.ResponseWriter) *sse {
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher) // httptest's ResponseWriter is one
	return &sse{w: w, f: f}
}

// send writes one event: an "event:" line when name is not empty, then
// data as one "data:" line (JSON unless it is a string), then a blank line.
func (s *sse) send(name string, data any) {
	var b strings.Builder
	if name != "" {
		b.WriteString("event: " + name + "\n")
	}
	text, ok := data.(string)
	if !ok {
		raw, err := json.Marshal(data)
		if err != nil {
			// Events are maps of strings and numbers, which encode; were
			// one not to, it is dropped and the client fails on the gap.
			return
		}
		text = string(raw)
	}
	b.WriteString("data: " + text + "\n\n")
	_, _ = s.w.Write([]byte(b.String()))
	if s.f != nil {
		s.f.Flush()
	}
}

// words splits text after each space, so that joining the pieces gives
// text; text without a space is one piece, and empty text none.
func words(text string) []string {
	var out []string
	for _, p := range strings.SplitAfter(text, " ") {
		if p != "" {
			out = append(out, p)
		}
	}
	return out
}

// pieces splits s into pieces of at most n bytes, never inside a UTF-8
// sequence (a piece holds at least one rune), so that joining them gives s.
func pieces(s string, n int) []string {
	var out []string
	for s != "" {
		end := 0
		for end < len(s) {
			_, size := utf8.DecodeRuneInString(s[end:])
			if end > 0 && end+size > n {
				break
			}
			end += size
		}
		out = append(out, s[:end])
		s = s[end:]
	}
	return out
}

// streamAnthropic answers as the Messages API streams
// (https://docs.anthropic.com/en/docs/build-with-claude/streaming):
// message_start (the message without content, its usage the input and
// cache counts and 1 output token), a ping, then per content block a
// content_block_start, its deltas (text_delta pieces of Text, or for a
// tool_use block an empty input_json_delta and then the compacted input
// in pieces) and a content_block_stop, then message_delta (stop_reason
// and the final usage, cache counts included) and message_stop.
func streamAnthropic(w http.ResponseWriter, id int64, req Request, resp Response) {
	w.Header().Set("request-id", fmt.Sprintf("req_fake_%04d", id))
	s := startSSE(w)
	final := anthropicUsage(resp, req)
	start := map[string]int64{
		"input_tokens":                final["input_tokens"],
		"output_tokens":               1,
		"cache_read_input_tokens":     final["cache_read_input_tokens"],
		"cache_creation_input_tokens": final["cache_creation_input_tokens"],
	}
	s.send("message_start", map[string]any{"type": "message_start", "message": map[string]any{
		"id":            fmt.Sprintf("msg_fake_%04d", id),
		"type":          "message",
		"role":          "assistant",
		"content":       []any{},
		"model":         req.Model,
		"stop_reason":   nil,
		"stop_sequence": nil,
		"usage":         start,
	}})
	s.send("ping", map[string]string{"type": "ping"})

	index := 0
	block := func(start map[string]any, deltas []map[string]any) {
		s.send("content_block_start", map[string]any{"type": "content_block_start", "index": index, "content_block": start})
		for _, d := range deltas {
			s.send("content_block_delta", map[string]any{"type": "content_block_delta", "index": index, "delta": d})
		}
		s.send("content_block_stop", map[string]any{"type": "content_block_stop", "index": index})
		index++
	}
	if resp.Text != "" {
		var deltas []map[string]any
		for _, p := range words(resp.Text) {
			deltas = append(deltas, map[string]any{"type": "text_delta", "text": p})
		}
		block(map[string]any{"type": "text", "text": ""}, deltas)
	}
	for _, tc := range anthropicToolUses(id, resp) {
		deltas := []map[string]any{{"type": "input_json_delta", "partial_json": ""}}
		for _, p := range pieces(tc.input, argumentPiece) {
			deltas = append(deltas, map[string]any{"type": "input_json_delta", "partial_json": p})
		}
		block(map[string]any{"type": "tool_use", "id": tc.id, "name": tc.name, "input": map[string]any{}}, deltas)
	}

	s.send("message_delta", map[string]any{
		"type":  "message_delta",
		"delta": map[string]any{"stop_reason": anthropicStopReason(resp), "stop_sequence": nil},
		"usage": final,
	})
	s.send("message_stop", map[string]string{"type": "message_stop"})
}

// streamOpenAI answers as Chat Completions streams
// (https://platform.openai.com/docs/api-reference/chat-streaming):
// "data:" lines of chat.completion.chunk objects, the first with the
// assistant role and empty content, then the pieces of Text as content
// deltas, then per tool call a delta with its index, id, type and name
// (empty arguments) and deltas with pieces of its arguments, then a
// chunk with an empty delta and the finish_reason; with
// stream_options.include_usage, every chunk has "usage": null and a last
// chunk with no choices carries the usage. Then "data: [DONE]".
func streamOpenAI(w http.ResponseWriter, id int64, req Request, resp Response) {
	s := startSSE(w)
	created := time.Now().Unix()
	chunk := func(choices []map[string]any, usage any) map[string]any {
		c := map[string]any{
			"id":                 fmt.Sprintf("chatcmpl-fake-%04d", id),
			"object":             "chat.completion.chunk",
			"created":            created,
			"model":              req.Model,
			"system_fingerprint": nil,
			"choices":            choices,
		}
		if req.StreamUsage {
			c["usage"] = usage
		}
		return c
	}
	delta := func(d map[string]any, finish any) {
		s.send("", chunk([]map[string]any{{"index": 0, "delta": d, "logprobs": nil, "finish_reason": finish}}, nil))
	}

	delta(map[string]any{"role": "assistant", "content": "", "refusal": nil}, nil)
	for _, p := range words(resp.Text) {
		delta(map[string]any{"content": p}, nil)
	}
	for i, tc := range openAIToolCalls(id, resp) {
		delta(map[string]any{"tool_calls": []map[string]any{{
			"index": i, "id": tc.id, "type": "function", "function": map[string]string{"name": tc.name, "arguments": ""},
		}}}, nil)
		for _, p := range pieces(tc.input, argumentPiece) {
			delta(map[string]any{"tool_calls": []map[string]any{{"index": i, "function": map[string]string{"arguments": p}}}}, nil)
		}
	}
	delta(map[string]any{}, openAIFinishReason(resp))
	if req.StreamUsage {
		s.send("", chunk([]map[string]any{}, openAIUsage(resp, req)))
	}
	s.send("", "[DONE]")
}
