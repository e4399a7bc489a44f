package cli

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// TestJobInputIsNotOnDiskInPlainWhenEncrypted runs one job with and
// without --encryption-key-file and searches every file of the data
// directory for its input text: found without the key (else the search
// proves nothing), in none of its spellings with it.
func TestJobInputIsNotOnDiskInPlainWhenEncrypted(t *testing.T) {
	t.Parallel()
	const secret = "canary-input-7d2c91e4-the-text-of-a-job"
	wf := writeWorkflow(t, testsupport.NoopChain("enc", 2))
	input := writeFile(t, "input.json", `{"note": "`+secret+`"}`)
	key := writeFile(t, "key", "0123456789abcdef0123456789abcdef0123456789abcdef\n")
	search := func(dir string) []string {
		var hits []string
		forms := canaryForms(secret)
		_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return nil
			}
			data, _ := os.ReadFile(p)
			for name, f := range forms {
				if strings.Contains(string(data), f) {
					hits = append(hits, name+" in "+p)
				}
			}
			return nil
		})
		return hits
	}
	plain, encrypted := t.TempDir(), t.TempDir()
	for _, r := range []struct {
		dir  string
		args []string
	}{{plain, nil}, {encrypted, []string{"--encryption-key-file", key}}} {
		out, errOut, code := execute(t, append([]string{"run", wf, "--input", input, "--data-dir", r.dir, "--sync", "always"}, r.args...)...)
		if code != 0 {
			t.Fatalf("run %v: exit %d\n%s\n%s", r.args, code, out, errOut)
		}
	}
	if len(search(plain)) == 0 {
		t.Fatal("the unencrypted data directory does not hold the input in plain: this test cannot see encryption")
	}
	if hits := search(encrypted); len(hits) > 0 {
		t.Fatalf("encrypted data directory holds the input: %v", hits)
	}
	// The key is needed again, and only the right one will do.
	_, errOut, code := execute(t, "run", wf, "--input", input, "--data-dir", encrypted)
	if code == 0 || !strings.Contains(errOut, "written encrypted") || !strings.Contains(errOut, "--encryption-key-file") {
		t.Fatalf("run without the key: exit %d\n%s", code, errOut)
	}
	wrong := writeFile(t, "wrong", "ffffffffffffffffffffffffffffffffffffffffffffffff")
	_, errOut, code = execute(t, "run", wf, "--input", input, "--data-dir", encrypted, "--encryption-key-file", wrong)
	if code == 0 || !strings.Contains(errOut, "not the one it was written with") {
		t.Fatalf("run with another key: exit %d\n%s", code, errOut)
	}
	_, errOut, code = execute(t, "run", wf, "--input", input, "--data-dir", t.TempDir(), "--encryption-key-file", writeFile(t, "short", "short\n"))
	if code != 2 || !strings.Contains(errOut, "at least 32") || strings.Contains(errOut, "short\n") && strings.Contains(errOut, "key is short") {
		t.Fatalf("a short key: exit %d\n%s", code, errOut)
	}
}
