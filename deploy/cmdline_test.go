package deploy_test

import (
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/cli"
	"github.com/waymark-dev/waymark/internal/workercli"
)

// fileFlags take a path to a file or directory the process reads.
var fileFlags = []string{"creds", "nkey", "tlscert", "tlskey", "tlsca", "http-token-file",
	"http-tlscert", "http-tlskey", "http-tlsca", "secrets-dir", "prices"}

// commandLine is an engine or worker command line parsed by the real
// command's flags.
type commandLine struct {
	binary string         // "engine" or "worker"
	cmd    *cobra.Command // the (sub)command the line runs
}

// value returns the flag's value: as given on the line, or its default.
func (c *commandLine) value(name string) string {
	if f := c.cmd.Flag(name); f != nil {
		return f.Value.String()
	}
	return ""
}

// given reports whether the line sets the flag.
func (c *commandLine) given(name string) bool {
	f := c.cmd.Flag(name)
	return f != nil && f.Changed
}

// parseCommandLine parses argv (argv[0] the binary's path) with the flags
// of the command it names: internal/cli's engine command tree or
// internal/workercli's worker command. Nothing is run. Errors (an unknown
// binary, subcommand or flag, a bad value, stray arguments) fail t,
// naming where the line came from.
func parseCommandLine(t *testing.T, where string, argv []string) *commandLine {
	t.Helper()
	if len(argv) == 0 {
		t.Fatalf("%s: empty command line", where)
	}
	var root *cobra.Command
	bin := filepath.Base(argv[0])
	switch bin {
	case "engine":
		root = cli.NewEngineCommand(io.Discard, io.Discard)
	case "worker":
		root = workercli.New(io.Discard, io.Discard, nil)
	default:
		t.Fatalf("%s: binary %q: want engine or worker", where, argv[0])
	}
	cmd, rest, err := root.Find(argv[1:])
	if err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	cl := &commandLine{binary: bin, cmd: cmd}
	kept := rest
	if err := cmd.ParseFlags(kept); err != nil {
		t.Fatalf("%s: %s %s: %v", where, cmd.CommandPath(), strings.Join(kept, " "), err)
	}
	if err := cmd.ValidateArgs(cmd.Flags().Args()); err != nil {
		t.Fatalf("%s: %s: %v", where, cmd.CommandPath(), err)
	}
	if !cmd.Runnable() || cmd.HasAvailableSubCommands() {
		t.Fatalf("%s: %q runs no command (a group: name one of its subcommands)", where, cmd.CommandPath())
	}
	return cl
}

// listenAddr checks a host:port address with a fixed port.
func listenAddr(addr string) (int, error) {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("want a fixed port")
	}
	return n, nil
}

// listenPort returns the port of a host:port flag value.
func listenPort(t *testing.T, where, flag, addr string) int {
	t.Helper()
	n, err := listenAddr(addr)
	if err != nil {
		t.Fatalf("%s: --%s %q: %v", where, flag, addr, err)
	}
	return n
}

func TestParseCommandLineRefusesRenamedFlag(t *testing.T) {
	// The check the whole suite leans on: an unknown flag fails parsing.
	for _, argv := range [][]string{
		{"/usr/local/bin/engine", "serve", "--no-such-flag=1"},
		{"/usr/local/bin/worker", "--pools=default"},
	} {
		root := map[string]func() *cobra.Command{
			"engine": func() *cobra.Command { return cli.NewEngineCommand(io.Discard, io.Discard) },
			"worker": func() *cobra.Command { return workercli.New(io.Discard, io.Discard, nil) },
		}[filepath.Base(argv[0])]()
		cmd, rest, err := root.Find(argv[1:])
		if err != nil {
			t.Fatalf("%v: %v", argv, err)
		}
		if err := cmd.ParseFlags(rest); err == nil {
			t.Errorf("%v: parsed; want an unknown-flag error", argv)
		}
	}
}
