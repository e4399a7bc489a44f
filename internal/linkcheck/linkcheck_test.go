package linkcheck

import (
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

const module = "github.com/waymark-dev/waymark"

// forbidden packages: an exact import path, or a path ending in "/..."
// for everything below it.
var (
	enginePkg  = module + "/engine"
	natsServer = "github.com/nats-io/nats-server/v2/..."
)

// TestLinkage: each row is a package (a library a user's program imports,
// or a main package) and what it must not link. Add a row per light
// package.
func TestLinkage(t *testing.T) {
	t.Parallel()
	rows := []struct {
		pkg    string
		forbid []string
	}{
		{module + "/workercmd", []string{enginePkg, natsServer}},
		{module + "/cmd/worker", []string{enginePkg, natsServer}},
		// A program that only starts and watches jobs.
		{module + "/engine/client", []string{enginePkg, natsServer}},
	}
	for _, r := range rows {
		t.Run(strings.TrimPrefix(r.pkg, module+"/"), func(t *testing.T) {
			t.Parallel()
			deps := listDeps(t, r.pkg)
			if _, ok := deps[r.pkg]; !ok {
				t.Fatalf("go list -deps %s does not list the package itself", r.pkg)
			}
			for _, f := range r.forbid {
				var linked []string
				for p := range deps {
					if matches(f, p) {
						linked = append(linked, p)
					}
				}
				if len(linked) > 0 {
					slices.Sort(linked)
					t.Errorf("%s links %s (%d packages), first %s through %s", r.pkg, f, len(linked), linked[0],
						strings.Join(chain(deps, r.pkg, linked[0]), " -> "))
				}
			}
		})
	}
}

func matches(pattern, pkg string) bool {
	if base, ok := strings.CutSuffix(pattern, "/..."); ok {
		return pkg == base || strings.HasPrefix(pkg, base+"/")
	}
	return pkg == pattern
}

// listDeps returns every package pkg links (itself included), each with
// its direct imports, from `go list -deps -json` run in the module.
func listDeps(t *testing.T, pkg string) map[string][]string {
	t.Helper()
	cmd := exec.Command("go", "list", "-deps", "-json=ImportPath,Imports", pkg)
	cmd.Dir = testsupport.ModuleRoot()
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, ee.Stderr)
		}
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	deps := map[string][]string{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p struct {
			ImportPath string
			Imports    []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		deps[p.ImportPath] = p.Imports
	}
	return deps
}

// chain returns a shortest import path from -> to, for the message.
func chain(deps map[string][]string, from, to string) []string {
	prev := map[string]string{from: ""}
	queue := []string{from}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		if p == to {
			var path []string
			for ; p != ""; p = prev[p] {
				path = append([]string{p}, path...)
			}
			return path
		}
		for _, next := range deps[p] {
			if _, seen := prev[next]; !seen {
				prev[next] = p
				queue = append(queue, next)
			}
		}
	}
	return []string{from, "?", to}
}
