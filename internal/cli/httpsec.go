package cli

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/waymark-dev/waymark/internal/httpauth"
)

// httpSecFlags secure engine serve's HTTP API.
type httpSecFlags struct {
	tokenFile string // --http-token-file; env WAYMARK_HTTP_TOKEN_FILE
	cert      string // --http-tlscert; env WAYMARK_HTTP_TLSCERT
	key       string // --http-tlskey; env WAYMARK_HTTP_TLSKEY
	ca        string // --http-tlsca; env WAYMARK_HTTP_TLSCA
	flags     *pflag.FlagSet
}

func (h *httpSecFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	h.flags = f
	f.StringVar(&h.tokenFile, "http-token-file", os.Getenv("WAYMARK_HTTP_TOKEN_FILE"), "file of bearer tokens the HTTP API accepts, one per line ('#' comments); SIGHUP reloads it (env WAYMARK_HTTP_TOKEN_FILE)")
	f.StringVar(&h.cert, "http-tlscert", os.Getenv("WAYMARK_HTTP_TLSCERT"), "serve the HTTP API over HTTPS with this certificate, with --http-tlskey (env WAYMARK_HTTP_TLSCERT)")
	f.StringVar(&h.key, "http-tlskey", os.Getenv("WAYMARK_HTTP_TLSKEY"), "private key of --http-tlscert (env WAYMARK_HTTP_TLSKEY)")
	f.StringVar(&h.ca, "http-tlsca", os.Getenv("WAYMARK_HTTP_TLSCA"), "require HTTP API clients to present a certificate signed by this CA (mTLS; needs --http-tlscert) (env WAYMARK_HTTP_TLSCA)")
}

// httpSecurity is what the flags set up; nil is a loopback API without
// authentication.
type httpSecurity struct {
	tokens *httpauth.Tokens
	tls    *tls.Config
	mtls   bool
}

// load reads the files the flags name and refuses an API beyond loopback
// without authentication, before anything starts. Errors name the flag.
func (h *httpSecFlags) load(addr string, log *slog.Logger) (*httpSecurity, error) {
	sec := &httpSecurity{}
	if h.ca != "" && h.cert == "" {
		return nil, fmt.Errorf("%s needs --http-tlscert and --http-tlskey: client certificates are checked over HTTPS", flagValue(h.flags, "http-tlsca", "WAYMARK_HTTP_TLSCA", h.ca))
	}
	var err error
	if sec.tls, err = httpauth.ServerTLS(h.cert, h.key, h.ca); err != nil {
		return nil, err
	}
	sec.mtls = h.ca != ""
	if h.tokenFile != "" {
		if sec.tokens, err = httpauth.LoadTokens(h.tokenFile); err != nil {
			return nil, fmt.Errorf("%s: %w", flagValue(h.flags, "http-token-file", "WAYMARK_HTTP_TOKEN_FILE", h.tokenFile), err)
		}
	}
	if err := httpauth.CheckExposure(addr, sec.tokens != nil, sec.mtls); err != nil {
		return nil, err
	}
	if sec.tokens != nil && sec.tls == nil && !httpauth.IsLoopback(addr) {
		log.Warn("the HTTP API takes bearer tokens over plain HTTP beyond loopback: anyone on the path can read them; add --http-tlscert and --http-tlskey, or terminate TLS in front of it", "http", addr)
	}
	if sec.tokens == nil && !sec.mtls && sec.tls == nil {
		return nil, nil
	}
	return sec, nil
}

// wrap puts authentication in front of h (nothing for a nil sec).
func (sec *httpSecurity) wrap(h http.Handler) http.Handler {
	if sec == nil || (sec.tokens == nil && !sec.mtls) {
		return h // HTTPS on loopback without authentication
	}
	return httpauth.Require(sec.tokens, h)
}

// tlsConfig is the API's TLS configuration; nil serves plain HTTP.
func (sec *httpSecurity) tlsConfig() *tls.Config {
	if sec == nil {
		return nil
	}
	return sec.tls
}

func (sec *httpSecurity) scheme() string {
	if sec != nil && sec.tls != nil {
		return "https"
	}
	return "http"
}

// describe says how the API authenticates, for the start-up lines.
func (sec *httpSecurity) describe() string {
	if sec == nil || (sec.tokens == nil && !sec.mtls) {
		return "no authentication: loopback only"
	}
	var ways []string
	if sec.tokens != nil {
		ways = append(ways, fmt.Sprintf("bearer tokens (%d)", sec.tokens.Len()))
	}
	if sec.mtls {
		ways = append(ways, "client certificates")
	}
	return "authentication: " + strings.Join(ways, " or ")
}

// reloadOnHUP reloads the token file on SIGHUP until the returned stop is
// called. A file that no longer loads keeps the tokens in use.
func (sec *httpSecurity) reloadOnHUP(log *slog.Logger) (stop func()) {
	if sec == nil || sec.tokens == nil {
		return func() {}
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-hup:
				if err := sec.tokens.Reload(); err != nil {
					log.Error("SIGHUP: token file not reloaded; the tokens in use stay", "err", err)
				} else {
					log.Info("SIGHUP: token file reloaded", "tokens", sec.tokens.Len())
				}
			case <-done:
				return
			}
		}
	}()
	return func() {
		signal.Stop(hup)
		close(done)
	}
}
