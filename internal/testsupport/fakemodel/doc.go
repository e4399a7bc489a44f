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
// Servers shut down in t.Cleanup. Handlers run concurrently, one goroutine
// per request, as in net/http.
package fakemodel
