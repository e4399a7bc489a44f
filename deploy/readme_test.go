package deploy_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestREADMENamesEveryFile: the README's Production section is how users
// find these files; each one must be named there.
func TestREADMENamesEveryFile(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	start := strings.Index(text, "\n## Production\n")
	if start < 0 {
		t.Fatal("README.md: no \"## Production\" section")
	}
	section := text[start+1:]
	if end := strings.Index(section[1:], "\n## "); end >= 0 {
		section = section[:end+1]
	}
	for _, dir := range []string{"nats", "helm", "k8s", "systemd"} {
		files, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if !f.IsDir() && !strings.Contains(section, f.Name()) {
				t.Errorf("README.md, Production: deploy/%s is not named", filepath.Join(dir, f.Name()))
			}
		}
	}
}
