// Package fakemodel runs in-process model servers for tests: httptest
// servers that speak the wire formats of the Anthropic Messages API
// (POST /v1/messages) and the OpenAI Chat Completions API
// (POST /v1/chat/completions), so the official SDK clients can be tested
// end to end without a network.
//
// A test scripts a server with a [Handler] that turns each request into a
// [Response] (a status and a reply text), and afterwards asserts on the
// [Request]s the server saw:
//
//	srv := fakemodel.NewAnthropic(t, fakemodel.Queue(
//		fakemodel.Response{Status: 429, Text: "slow down"},
//		fakemodel.Response{Text: "positive"},
//	))
//	p := providers.NewAnthropic(providers.Config{APIKey: "k", BaseURL: srv.URL()})
//	...
//	got := srv.Requests() // what the SDK sent, in arrival order
//
// A Response may carry ToolCalls (tool_use blocks, or an assistant
// message's tool_calls, with stop reason tool_use or tool_calls) and
// prompt-cache usage; a Request decodes the messages, content blocks,
// tools and cache_control marks the SDK sent. Like the real APIs, a
// server answers 400, without calling the Handler, to a conversation
// whose tool results do not answer the previous assistant turn's tool
// calls, so a test catches a dangling tool call.
//
// A request with "stream": true (Request.Stream) is answered as the APIs
// stream, as server-sent events, with the same reply it would get
// without: Anthropic's message_start, content_block_start,
// content_block_delta (text_delta, or input_json_delta for a tool_use
// block), content_block_stop, message_delta (stop reason, usage with the
// cache counts) and message_stop events; OpenAI's chat.completion.chunk
// "data:" lines (the role, content deltas, tool_calls deltas by index
// with the id and name first and the arguments in pieces, the
// finish_reason, then, with stream_options.include_usage
// (Request.StreamUsage), a usage chunk without choices) ending with
// "data: [DONE]". Text is sent in pieces split after each space and tool
// input in pieces of a few bytes, so a client sees several deltas. An
// error status is answered as JSON, as the APIs answer an error before
// the stream starts; RawBody, sent as it is, can script a stream that
// breaks off or carries an error event.
//
// Servers shut down in t.Cleanup. Handlers run concurrently, one goroutine
// per request, as in net/http.
package fakemodel
