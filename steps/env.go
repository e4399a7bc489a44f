package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"sort"
	"strings"
	"text/template"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// Model modes: how a model step picks between a live provider and its
// cassette.
const (
	// ModelAuto calls the live provider when its API key is set (or the
	// step names a base_url), else replays the step's cassette.
	ModelAuto = "auto"
	// ModelLive always calls the live provider.
	ModelLive = "live"
	// ModelReplay always answers from the cassette; nothing leaves the
	// machine.
	ModelReplay = "replay"
)

// RecordCassetteEnv names the environment variable that, when set to a
// file path, records every live model reply into that cassette file.
const RecordCassetteEnv = "WAYMARK_RECORD_CASSETTE"

// Env is what a worker gives its step kinds from outside the definition.
// The zero value works: no services, ModelAuto, os.Getenv, secrets from
// WAYMARK_SECRET_* variables only, a default HTTP client.
type Env struct {
	// Services maps a service name to its base URL, for {{service "name"}}
	// in templates. Definitions name services, workers know where they are.
	Services map[string]string
	// ModelMode is ModelAuto (default), ModelLive or ModelReplay.
	ModelMode string
	// Getenv reads the environment (API keys, WAYMARK_SECRET_* secrets);
	// nil means os.Getenv. Values read are never stored.
	Getenv func(string) string
	// Secrets says where {{secret "NAME"}} and api_key_secret find values
	// besides WAYMARK_SECRET_<NAME>; see Secrets.
	Secrets Secrets
	// HTTPClient makes http steps' and model providers' requests; nil means
	// a client with no overall timeout (steps carry their own deadlines).
	HTTPClient *http.Client
	// ProviderURLs overrides a model provider's base URL by provider name
	// ("anthropic", "openai"): for proxies and tests.
	ProviderURLs map[string]string
	// Prices prices model tokens by model name (or name prefix), per
	// million tokens, for agent steps whose definition has no prices
	// (--prices FILE); nil: none.
	Prices map[string]schemas.Price
	// MCPServers maps a name to the command line of an MCP server the
	// worker starts for an mcp step that names it (with.server), speaking
	// MCP over its stdin and stdout. A definition names servers; only the
	// worker says what runs.
	MCPServers map[string][]string
	// RateLimits is where workers share providers' rate limits (a 429's
	// Retry-After); nil: each call finds the limit on its own. NewWorker
	// sets the store's (kv.Limits) when it is nil.
	RateLimits RateLimits
}

// RateLimits holds, per provider and API key (name), the time before
// which no worker calls it. kv.Limits is the JetStream one.
type RateLimits interface {
	Until(ctx context.Context, name string) (time.Time, error)
	Hold(ctx context.Context, name string, until time.Time) error
}

func (e *Env) getenv(k string) string {
	if e == nil || e.Getenv == nil {
		return os.Getenv(k)
	}
	return e.Getenv(k)
}

func (e *Env) httpClient() *http.Client {
	if e == nil || e.HTTPClient == nil {
		return http.DefaultClient
	}
	return e.HTTPClient
}

func (e *Env) modelMode() string {
	if e == nil || e.ModelMode == "" {
		return ModelAuto
	}
	return e.ModelMode
}

// Service returns the base URL of the named service. Errors list the
// services the worker knows.
func (e *Env) Service(name string) (string, error) {
	if e != nil {
		if u, ok := e.Services[name]; ok {
			return strings.TrimRight(u, "/"), nil
		}
	}
	var known []string
	if e != nil {
		for k := range e.Services {
			known = append(known, k)
		}
	}
	sort.Strings(known)
	return "", &MissingServiceError{Name: name, Known: known}
}

// MissingServiceError says a template named a service this worker was not
// given. The worker hands the step back (another worker may have the
// service) instead of failing it.
type MissingServiceError struct {
	Name  string
	Known []string
}

func (e *MissingServiceError) Error() string {
	return fmt.Sprintf("no service named %q (give the worker --service %s=URL; known: %s)", e.Name, e.Name, strings.Join(e.Known, ", "))
}

// serviceCallRE finds service calls with a literal name in a template:
// {{service "payments"}}, {{service `payments`}}.
var serviceCallRE = regexp.MustCompile("\\bservice\\s+(?:\"([^\"]*)\"|`([^`]*)`)")

// missingService returns the first service that the templates in a step's
// settings (with, as JSON) name literally and env lacks, or nil. A name
// computed at run time is found when the template runs.
func missingService(with json.RawMessage, env *Env) *MissingServiceError {
	if len(with) == 0 {
		return nil
	}
	var v any
	if json.Unmarshal(with, &v) != nil {
		return nil
	}
	var found *MissingServiceError
	var walk func(any)
	walk = func(v any) {
		switch x := v.(type) {
		case string:
			for _, m := range serviceCallRE.FindAllStringSubmatch(x, -1) {
				name := m[1] + m[2]
				if _, err := env.Service(name); err != nil && found == nil {
					errors.As(err, &found)
				}
			}
		case []any:
			for _, e := range x {
				walk(e)
			}
		case map[string]any:
			keys := make([]string, 0, len(x))
			for k := range x {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				walk(x[k])
			}
		}
	}
	walk(v)
	return found
}

// ParseServices parses "name=url" pairs, as --service flags give them.
func ParseServices(pairs []string) (map[string]string, error) {
	out := map[string]string{}
	for _, p := range pairs {
		name, url, ok := strings.Cut(p, "=")
		if !ok || name == "" || url == "" {
			return nil, fmt.Errorf("service %q: want name=URL", p)
		}
		if !strings.HasPrefix(url, "http://") && !strings.HasPrefix(url, "https://") {
			return nil, fmt.Errorf("service %s: URL %q must start with http:// or https://", name, url)
		}
		out[name] = url
	}
	return out, nil
}

// UntrustedOpen and UntrustedClose delimit untrusted text in prompts
// (DESIGN.md invariant 7): the {{untrusted}} template function wraps its
// argument in them and defuses any copy of them inside.
const (
	UntrustedOpen  = "<untrusted-data>"
	UntrustedClose = "</untrusted-data>"
)

// untrustedTagRE finds copies of the delimiters in any letter case.
var untrustedTagRE = regexp.MustCompile(`(?i)<(/?)\s*untrusted-data\s*>`)

// templateFuncs are the functions step templates may call: json, untrusted,
// service, secret, join, lower, upper, trim, urlpart, raw. None reads the clock, so
// rendering the same state twice gives the same text. secret is bound per
// call (stepTemplate.execute); this one only refuses.
func templateFuncs(env *Env) template.FuncMap {
	return template.FuncMap{
		"json":    schemas.TemplateJSON,
		"urlpart": urlPart,
		"raw":     func(v any) any { return v },
		"untrusted": func(v any) string {
			s, ok := v.(string)
			if !ok {
				b, err := json.Marshal(v)
				if err != nil {
					s = fmt.Sprint(v)
				} else {
					s = string(b)
				}
			}
			return UntrustedOpen + "\n" + untrustedTagRE.ReplaceAllString(s, "<${1}untrusted_data>") + "\n" + UntrustedClose
		},
		"service": env.Service,
		"join": func(sep string, xs []any) string {
			parts := make([]string, len(xs))
			for i, x := range xs {
				parts[i] = fmt.Sprint(x)
			}
			return strings.Join(parts, sep)
		},
		"secret": secretFunc,
		"lower":  strings.ToLower,
		"upper":  strings.ToUpper,
		"trim":   strings.TrimSpace,
	}
}

// newTemplate parses text as a step template: unknown keys are errors
// (missingkey=error) so a typo fails the attempt instead of rendering
// "<no value>". service resolves through env.
func newTemplate(name, text string, env *Env) (*template.Template, error) {
	t, err := template.New(name).Option("missingkey=error").Funcs(templateFuncs(env)).Parse(text)
	if err != nil {
		return nil, fmt.Errorf("template %s: %w", name, err)
	}
	return t, nil
}

// parseTemplate parses text as a step template that may not read secrets:
// prompts (a model could repeat a secret into its output), idempotency
// keys (stored in the ledger) and anything else whose rendering is kept or
// shown. An http step's request templates use parseSecretTemplate.
func parseTemplate(name, text string, env *Env) (*template.Template, error) {
	t, err := newTemplate(name, text, env)
	if err != nil {
		return nil, err
	}
	names, err := secretCalls(t)
	if err != nil || len(names) > 0 {
		return nil, fmt.Errorf("template %s: {{secret}} is not allowed here: secrets go only into an http step's url, headers and body (and a model step's key, through api_key_secret), whose rendering is sent and never stored", name)
	}
	return t, nil
}

// render executes t over data.
func render(t *template.Template, data any) (string, error) {
	var b strings.Builder
	if err := t.Execute(&b, data); err != nil {
		return "", fmt.Errorf("render %s: %w", t.Name(), err)
	}
	return b.String(), nil
}

func (e *Env) providerURL(provider string) string {
	if e == nil {
		return ""
	}
	return e.ProviderURLs[provider]
}
