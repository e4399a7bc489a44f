package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// mcpStdioEnv makes this test binary an MCP server over stdio (TestMain),
// writing each call it serves to the file the variable names.
const mcpStdioEnv = "WAYMARK_TEST_MCP_STDIO"

type cityArgs struct {
	City string `json:"city"`
}

type weather struct {
	City    string `json:"city"`
	Celsius int    `json:"celsius"`
}

// weatherServer is an MCP server with a lookup tool (and a tool that
// always fails); calls counts the lookups.
func weatherServer(calls *atomic.Int64, onCall func(city string)) *mcp.Server {
	s := mcp.NewServer(&mcp.Implementation{Name: "weather", Version: "1"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "lookup", Description: "Current weather of a city."},
		func(ctx context.Context, _ *mcp.CallToolRequest, in cityArgs) (*mcp.CallToolResult, weather, error) {
			calls.Add(1)
			if onCall != nil {
				onCall(in.City)
			}
			return nil, weather{City: in.City, Celsius: 19}, nil
		})
	mcp.AddTool(s, &mcp.Tool{Name: "explode", Description: "Always fails."},
		func(ctx context.Context, _ *mcp.CallToolRequest, in cityArgs) (*mcp.CallToolResult, any, error) {
			return &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: "no weather on " + in.City}}}, nil, nil
		})
	return s
}

func serveMCPStdio() {
	var calls atomic.Int64
	mark := os.Getenv(mcpStdioEnv)
	s := weatherServer(&calls, func(city string) {
		f, err := os.OpenFile(mark, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			fmt.Fprintln(f, city)
			_ = f.Close()
		}
	})
	_ = s.Run(context.Background(), &mcp.StdioTransport{})
}

// TestAgentToolsServedByMCP: an agent's tools served by MCP servers
// through the official SDK, one over streamable HTTP and one over the
// stdio of a command the worker was given (--mcp-server); a tool whose
// result says it failed, an unsafe tool whose server is down and one the
// server does not have become error results the model reads (nothing
// happened: none waits for a person).
func TestAgentToolsServedByMCP(t *testing.T) {
	t.Parallel()
	var httpCalls atomic.Int64
	srv := weatherServer(&httpCalls, nil)
	hs := httptest.NewServer(mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv }, &mcp.StreamableHTTPOptions{Stateless: true}))
	t.Cleanup(hs.Close)
	dir := t.TempDir()
	cassette := `{"version": 1, "interactions": [
	  {"step": "agent", "turn": 1, "replies": [{"text": "", "stop_reason": "tool_use", "tool_calls": [
	    {"id": "c1", "name": "weather_http", "input": {"city": "Paris"}},
	    {"id": "c2", "name": "weather_local", "input": {"city": "Rome"}},
	    {"id": "c3", "name": "broken", "input": {"city": "Mars"}},
	    {"id": "c4", "name": "down", "input": {"city": "Lima"}},
	    {"id": "c5", "name": "nosuch", "input": {}}]}]},
	  {"step": "agent", "turn": 2, "replies": [{"text": "Paris 19C, Rome 19C."}]}]}`
	wf := fmt.Sprintf(`
name: mcp-agent
version: 1
assets: {cassette: cassette.json}
steps:
  - id: agent
    kind: agent
    save_as: out
    with: {provider: replay, prompt: "Weather?", cassette: cassette}
    tools:
      - {name: weather_http, kind: mcp, effect: pure, input_schema: {type: object}, with: {url: %q, tool: lookup}}
      - {name: weather_local, kind: mcp, effect: pure, input_schema: {type: object}, with: {server: local, tool: lookup}}
      - {name: broken, kind: mcp, effect: pure, retry: {max_attempts: 1}, with: {server: local, tool: explode}}
      - {name: down, kind: mcp, effect: unsafe, retry: {max_attempts: 2, backoff: {initial: 10ms}}, with: {url: "http://127.0.0.1:1/mcp", tool: lookup}}
      - {name: nosuch, kind: mcp, effect: unsafe, with: {server: local, tool: nosuchtool}}
`, hs.URL)
	for name, data := range map[string]string{"cassette.json": cassette, "agent.yaml": wf, "input.json": `{}`} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	mark := filepath.Join(dir, "stdio-calls.txt")
	bin := testsupport.Binary(t, "engine")
	p := spawn(t, []string{"WAYMARK_MODEL_MODE=replay", mcpStdioEnv + "=" + mark}, bin, "run", filepath.Join(dir, "agent.yaml"),
		"--input", filepath.Join(dir, "input.json"), "--data-dir", filepath.Join(dir, "data"), "--output", "json", "--mcp-server", "local="+self)
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		t.Fatal("engine run did not finish")
	}
	if p.err != nil {
		t.Fatalf("engine run: %v\n%s", p.err, lastLines(p.errOut.String(), 30))
	}
	v := decodeView(t, p.out.String())
	var st struct {
		Out schemas.AgentOutput `json:"out"`
	}
	_ = json.Unmarshal(v.State, &st)
	// An unsafe tool whose server is down, or that the server does not
	// have, did nothing: an error result, not an effect for a person.
	if v.Status != schemas.JobCompleted || st.Out.Turns != 2 || st.Out.ToolCalls != 5 || st.Out.ToolErrors != 3 {
		t.Fatalf("status %s output %+v", v.Status, st.Out)
	}
	if n := httpCalls.Load(); n != 1 {
		t.Errorf("streamable HTTP server calls %d, want 1", n)
	}
	got, _ := os.ReadFile(mark)
	if strings.TrimSpace(string(got)) != "Rome" {
		t.Errorf("stdio server calls %q, want Rome once", got)
	}
	if !strings.Contains(p.errOut.String(), "no weather on Mars") {
		t.Errorf("the failing tool's message is not in the log:\n%s", lastLines(p.errOut.String(), 20))
	}
}
