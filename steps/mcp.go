package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os/exec"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// KindMCP calls a tool of an MCP server (Model Context Protocol,
// https://modelcontextprotocol.io/specification) through the official Go
// SDK, over streamable HTTP (with.url) or over the stdio of a command the
// worker runs (with.server). As an agent's tool it sends the model's
// arguments; as a step, with.arguments rendered over the state.
const KindMCP = "mcp"

type mcpKind struct{}

// mcpConnectTimeout bounds connecting to an MCP server (the initialize
// handshake); the call itself has the step's timeout.
const mcpConnectTimeout = 30 * time.Second

type mcpWith struct {
	// URL is the server's streamable HTTP endpoint, a template
	// ({{service "search"}}/mcp); Server names a stdio server the worker
	// was given (--mcp-server NAME='command args'). Exactly one is set.
	URL    string `json:"url,omitempty"`
	Server string `json:"server,omitempty"`
	// Tool is the server's tool to call; required.
	Tool string `json:"tool"`
	// Headers are sent with every HTTP request (templates; secrets allowed).
	Headers map[string]string `json:"headers,omitempty"`
	// Arguments are a step's arguments: a JSON object whose string leaves
	// are templates, as an http step's body. An agent's tool call sends
	// the model's arguments instead.
	Arguments json.RawMessage `json:"arguments,omitempty"`
}

type mcpRunner struct {
	w       mcpWith
	url     *stepTemplate
	headers map[string]*stepTemplate
	args    body
	env     *Env
}

// Prepare checks the settings: a URL or a server the worker has, a tool.
func (mcpKind) Prepare(p *Prep) (Runner, error) {
	var w mcpWith
	if err := p.Decode(&w); err != nil {
		return nil, err
	}
	r := &mcpRunner{w: w, env: p.Env, headers: map[string]*stepTemplate{}}
	switch {
	case (w.URL == "") == (w.Server == ""):
		return nil, fmt.Errorf("an mcp step needs exactly one of with.url (streamable HTTP) and with.server (a stdio server the worker runs)")
	case w.Server != "" && len(w.Headers) > 0:
		return nil, fmt.Errorf("with.headers are for with.url; a stdio server gets none")
	}
	if w.Tool == "" {
		return nil, fmt.Errorf("with.tool is required: the MCP server's tool to call")
	}
	var err error
	if w.URL != "" {
		if r.url, err = parseURLTemplate(p.Step.ID+".url", w.URL, p.Env); err != nil {
			return nil, err
		}
	}
	for k, v := range w.Headers {
		if r.headers[k], err = parseSecretTemplate(p.Step.ID+".headers."+k, v, p.Env); err != nil {
			return nil, err
		}
	}
	if w.Server != "" && p.Env != nil && p.Env.MCPServers != nil {
		if _, ok := p.Env.MCPServers[w.Server]; !ok {
			return nil, fmt.Errorf("with.server %q: this worker has no MCP server of that name (give it --mcp-server %s='command args')", w.Server, w.Server)
		}
	}
	if p.Tool != "" && len(w.Arguments) > 0 {
		return nil, fmt.Errorf("with.arguments: an agent's mcp tool sends the model's arguments; remove with.arguments")
	}
	if r.args, err = compileBody(p.Step.ID, w.Arguments, p.Env); err != nil {
		return nil, err
	}
	return r, nil
}

// Run calls the tool; its output and error are scrubbed of the call's
// secrets.
func (r *mcpRunner) Run(ctx context.Context, c *Call) (any, error) {
	return c.scrubResult(r.run(ctx, c))
}

func (r *mcpRunner) run(ctx context.Context, c *Call) (any, error) {
	data, err := c.TemplateData()
	if err != nil {
		return nil, NonRetryable(err)
	}
	args := map[string]any{}
	switch {
	case c.Tool != "":
		if err := json.Unmarshal(c.ItemValue, &args); err != nil {
			return nil, NonRetryable(fmt.Errorf("the arguments of tool call %s are not a JSON object: %w", c.ItemName, err))
		}
	case r.args != nil:
		b, err := r.args.render(c, r.env, data)
		if err != nil {
			return nil, NonRetryable(err)
		}
		if err := json.Unmarshal(b, &args); err != nil {
			return nil, NonRetryable(fmt.Errorf("with.arguments must render to a JSON object: %w", err))
		}
	}
	transport, where, err := r.transport(ctx, c, data)
	if err != nil {
		return nil, err
	}
	client := mcp.NewClient(&mcp.Implementation{Name: "waymark-worker", Version: "1"}, nil)
	cctx, cancel := context.WithTimeout(ctx, mcpConnectTimeout)
	session, err := client.Connect(cctx, transport, nil)
	cancel()
	if err != nil {
		// No tool was called: whatever the tool's class, nothing happened.
		return nil, NotPerformed(Retryable(fmt.Errorf("mcp %s: connect: %w", where, err)))
	}
	defer session.Close()
	res, err := session.CallTool(ctx, &mcp.CallToolParams{Name: r.w.Tool, Arguments: args})
	var rpcErr *jsonrpc.Error
	switch {
	case errors.As(err, &rpcErr):
		// The server refused the call (an unknown tool, bad arguments): it
		// would refuse it again, and did nothing.
		return nil, NotPerformed(NonRetryable(fmt.Errorf("mcp %s: call tool %s: %w", where, r.w.Tool, err)))
	case err != nil:
		return nil, Retryable(fmt.Errorf("mcp %s: call tool %s: %w", where, r.w.Tool, err))
	}
	text := mcpText(res)
	if res.IsError {
		// The tool ran and said it failed: the same call would fail again.
		return nil, NonRetryable(fmt.Errorf("mcp %s: tool %s: %s", where, r.w.Tool, excerpt(text, 2000)))
	}
	if res.StructuredContent != nil {
		return res.StructuredContent, nil
	}
	return text, nil
}

// transport connects to the server: streamable HTTP at the rendered URL
// with the step's headers, or the worker's stdio command.
func (r *mcpRunner) transport(ctx context.Context, c *Call, data any) (mcp.Transport, string, error) {
	if r.w.Server != "" {
		argv := r.env.mcpServer(r.w.Server)
		if len(argv) == 0 {
			return nil, "", &MissingServiceError{Name: "mcp:" + r.w.Server}
		}
		return &mcp.CommandTransport{Command: exec.CommandContext(ctx, argv[0], argv[1:]...)}, "server " + r.w.Server, nil
	}
	u, err := r.url.execute(c, r.env, data)
	if err != nil {
		var missing *MissingServiceError
		if errors.As(err, &missing) {
			return nil, "", err
		}
		return nil, "", NonRetryable(err)
	}
	if pu, err := url.Parse(u); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
		return nil, "", NotPerformed(NonRetryable(fmt.Errorf("mcp with.url %q: want an http:// or https:// URL", redactURL(u))))
	}
	h := http.Header{}
	for k, t := range r.headers {
		v, err := t.execute(c, r.env, data)
		if err != nil {
			return nil, "", NonRetryable(err)
		}
		h.Set(k, v)
	}
	hc := *r.env.httpClient()
	base := hc.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	hc.Transport = headerTransport{base: base, h: h}
	return &mcp.StreamableClientTransport{Endpoint: u, HTTPClient: &hc, MaxRetries: -1}, redactURL(u), nil
}

// headerTransport adds headers to every request.
type headerTransport struct {
	base http.RoundTripper
	h    http.Header
}

func (t headerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	for k, v := range t.h {
		req.Header[k] = v
	}
	return t.base.RoundTrip(req)
}

// mcpText joins the text content of a tool result.
func mcpText(res *mcp.CallToolResult) string {
	var parts []string
	for _, c := range res.Content {
		if t, ok := c.(*mcp.TextContent); ok {
			parts = append(parts, t.Text)
		}
	}
	return strings.Join(parts, "\n")
}

// mcpServer returns the command line of the worker's MCP server name.
func (e *Env) mcpServer(name string) []string {
	if e == nil {
		return nil
	}
	return e.MCPServers[name]
}

// ParseMCPServers reads --mcp-server values, NAME='command args' each
// (the command line split at spaces). Errors name the value.
func ParseMCPServers(pairs []string) (map[string][]string, error) {
	out := map[string][]string{}
	for _, p := range pairs {
		name, cmd, ok := strings.Cut(p, "=")
		argv := strings.Fields(cmd)
		if !ok || name == "" || len(argv) == 0 {
			return nil, fmt.Errorf("--mcp-server %q: want NAME='command args'", p)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("--mcp-server %s: given twice", name)
		}
		out[name] = argv
	}
	return out, nil
}
