package cli

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMaxStoreSetting: --max-store and WAYMARK_MAX_STORE take sizes with
// units; a bad one is a usage error naming the flag (and the variable)
// before any server starts.
func TestMaxStoreSetting(t *testing.T) {
	quickstart := repo("examples/quickstart/workflow.yaml")
	input := repo("examples/quickstart/input.json")
	for _, tc := range []struct {
		name string
		env  string
		args []string
		want string
	}{
		{"flag", "", []string{"--max-store", "lots"}, `--max-store "lots": want a size such as 512MiB or 10GB`},
		{"variable", "huge", nil, `--max-store "huge" (from WAYMARK_MAX_STORE): want a size`},
		{"negative", "", []string{"--max-store", "-5MB"}, `--max-store "-5MB"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("WAYMARK_MAX_STORE", tc.env)
			for _, cmd := range [][]string{{"run", quickstart, "--input", input, "--model-mode", "replay"}, {"serve", "--http=", "--listen", "127.0.0.1:0"}} {
				dir := t.TempDir()
				out, errOut, code := execute(t, append(append(cmd, "--data-dir", dir), tc.args...)...)
				if code != 2 || !strings.Contains(errOut, tc.want) {
					t.Errorf("%s: exit %d, want 2 and %q\nstdout %s\nstderr %s", cmd[0], code, tc.want, out, errOut)
				}
				if _, err := os.Stat(filepath.Join(dir, "jetstream")); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s: a server started before the setting was refused (%v)", cmd[0], err)
				}
			}
		})
	}

	t.Run("a size with a unit runs", func(t *testing.T) {
		t.Setenv("WAYMARK_MAX_STORE", "64MiB")
		out, errOut, code := execute(t, "run", quickstart, "--input", input, "--model-mode", "replay",
			"--data-dir", t.TempDir(), "--sync", "interval")
		if code != 0 {
			t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
		}
	})
}
