package cliflags

import (
	"testing"
	"time"

	"github.com/spf13/cobra"
)

func TestReconnectDelayBacksOff(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		attempt int
		want    time.Duration // before jitter
	}{
		{1, 250 * time.Millisecond}, {2, 500 * time.Millisecond}, {3, time.Second}, {4, 2 * time.Second},
		{5, 4 * time.Second}, {6, 5 * time.Second}, {40, 5 * time.Second}, {0, 5 * time.Second}, {-3, 5 * time.Second},
	} {
		for range 50 {
			got := ReconnectDelay(tc.attempt)
			if got > tc.want || got < tc.want*4/5 {
				t.Fatalf("ReconnectDelay(%d) = %v, want within [%v, %v]", tc.attempt, got, tc.want*4/5, tc.want)
			}
		}
	}
}

func TestServerAliasParses(t *testing.T) {
	t.Parallel()
	// --server is the nats CLI's name for --nats-url: it must parse on the
	// command that binds the globals and on its subcommands.
	root := &cobra.Command{Use: "root"}
	var g Globals
	g.Bind(root)
	sub := &cobra.Command{Use: "sub", RunE: func(*cobra.Command, []string) error { return nil }}
	root.AddCommand(sub)
	for _, tc := range []struct {
		name string
		cmd  *cobra.Command
	}{{"root", root}, {"sub", sub}} {
		if err := tc.cmd.ParseFlags([]string{"--server", "nats://example:4222"}); err != nil {
			t.Fatalf("%s: --server: %v", tc.name, err)
		}
		if g.Conn.URL != "nats://example:4222" {
			t.Fatalf("%s: --server set the URL %q", tc.name, g.Conn.URL)
		}
		g.Conn.URL = ""
	}
}
