package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// KindStore reads and writes the session store (kv.SessionStore): values
// by namespace and key, kept across jobs. Its settings (storeWith) are
// templates over state, vars and, for an agent's tool, .args. Output: get
// {found, value, revision}; put {revision}; delete {deleted}; list
// {entries: [{key, value, revision}]}. A put or delete with
// expect_revision that finds another revision fails for good with code
// conflict (an agent reads why and can read again).
const KindStore = schemas.KindStore

type storeWith struct {
	Op             string          `json:"op"`        // get, put, delete or list
	Namespace      string          `json:"namespace"` // template
	Key            string          `json:"key,omitempty"`
	Value          json.RawMessage `json:"value,omitempty"`           // put: a JSON body, as http's with.body
	ExpectRevision string          `json:"expect_revision,omitempty"` // template: a number; "0": only when there is no value
}

type storeKind struct{}

// secretInTemplate finds a call of the secret function in template text.
var secretInTemplate = regexp.MustCompile(`\{\{[^}]*\bsecret\b`)

type storeRunner struct {
	op             string
	namespace, key *stepTemplate
	expect         *stepTemplate
	value          body
	env            *Env
}

func (storeKind) Prepare(p *Prep) (Runner, error) {
	var w storeWith
	if err := p.Decode(&w); err != nil {
		return nil, err
	}
	for what, text := range map[string]string{"namespace": w.Namespace, "key": w.Key, "expect_revision": w.ExpectRevision, "value": string(w.Value)} {
		if secretInTemplate.MatchString(text) {
			return nil, fmt.Errorf("step %s: with.%s: {{secret}} is not allowed in a store step: the store keeps what it writes, in the clear, for every job to read", p.Step.ID, what)
		}
	}
	r := &storeRunner{op: w.Op, env: p.Env}
	switch w.Op {
	case "get", "put", "delete":
		if w.Key == "" {
			return nil, fmt.Errorf("step %s: with.key is required for op %s", p.Step.ID, w.Op)
		}
	case "list":
	default:
		return nil, fmt.Errorf("step %s: with.op %q: want get, put, delete or list", p.Step.ID, w.Op)
	}
	if w.Namespace == "" {
		return nil, fmt.Errorf("step %s: with.namespace is required (a template: user-{{.state.user_id}})", p.Step.ID)
	}
	var err error
	if r.namespace, err = parseSecretTemplate(p.Step.ID+".namespace", w.Namespace, p.Env); err != nil {
		return nil, err
	}
	if w.Key != "" {
		if r.key, err = parseSecretTemplate(p.Step.ID+".key", w.Key, p.Env); err != nil {
			return nil, err
		}
	}
	if w.ExpectRevision != "" {
		if r.expect, err = parseSecretTemplate(p.Step.ID+".expect_revision", w.ExpectRevision, p.Env); err != nil {
			return nil, err
		}
	}
	switch {
	case w.Op == "put" && len(w.Value) == 0:
		return nil, fmt.Errorf("step %s: with.value is required for op put", p.Step.ID)
	case w.Op == "put":
		if r.value, err = compileBody(p.Step.ID, w.Value, p.Env); err != nil {
			return nil, err
		}
	case len(w.Value) > 0:
		return nil, fmt.Errorf("step %s: with.value is for op put", p.Step.ID)
	}
	return r, nil
}

// sameJSON reports whether a and b are the same JSON value.
func sameJSON(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return string(xa) == string(ya)
}

func (r *storeRunner) Run(ctx context.Context, c *Call) (any, error) {
	notDone := func(err error) error { return NotPerformed(NonRetryable(err)) }
	if c.Session == nil {
		return nil, notDone(errors.New("this worker has no session store"))
	}
	data, err := c.TemplateData()
	if err != nil {
		return nil, notDone(err)
	}
	render := func(t *stepTemplate) (string, error) {
		if t == nil {
			return "", nil
		}
		s, err := t.execute(c, r.env, data)
		return strings.TrimSpace(s), err
	}
	ns, err := render(r.namespace)
	if err != nil {
		return nil, notDone(err)
	}
	key, err := render(r.key)
	if err != nil {
		return nil, notDone(err)
	}
	if err := kv.CheckStoreName("namespace", ns); err != nil {
		return nil, notDone(err)
	}
	if r.key != nil {
		if err := kv.CheckStoreName("key", key); err != nil {
			return nil, notDone(err)
		}
	}
	var expect *uint64
	if r.expect != nil {
		s, err := render(r.expect)
		if err != nil {
			return nil, notDone(err)
		}
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return nil, notDone(schemas.Errorf(schemas.CodeInputInvalid, "expect_revision %q is not a revision (a number)", s))
		}
		expect = &n
	}
	bad := func(err error) error {
		switch {
		case errors.Is(err, schemas.ErrInputInvalid):
			return notDone(err)
		case errors.Is(err, schemas.ErrConflict):
			return notDone(schemas.Errorf(schemas.CodeConflict, "%s", strings.TrimSuffix(err.Error(), ": "+schemas.ErrConflict.Error())))
		}
		return err
	}
	switch r.op {
	case "get":
		e, err := c.Session.Get(ctx, ns, key)
		if errors.Is(err, schemas.ErrNotFound) {
			return map[string]any{"found": false, "revision": 0}, nil
		}
		if err != nil {
			return nil, bad(err)
		}
		return map[string]any{"found": true, "value": e.Value, "revision": e.Revision}, nil
	case "put":
		v, err := r.value.render(c, r.env, data)
		if err != nil {
			return nil, notDone(err)
		}
		rev, err := c.Session.Put(ctx, ns, key, v, expect)
		if errors.Is(err, schemas.ErrConflict) {
			// The value this attempt writes is there already (an attempt
			// before a crash wrote it): the same write.
			if e, gerr := c.Session.Get(ctx, ns, key); gerr == nil && sameJSON(e.Value, v) {
				return map[string]any{"revision": e.Revision}, nil
			}
		}
		if err != nil {
			return nil, bad(err)
		}
		return map[string]any{"revision": rev}, nil
	case "delete":
		err := c.Session.Delete(ctx, ns, key, expect)
		if errors.Is(err, schemas.ErrNotFound) {
			err = nil // nothing to remove: the outcome asked for
		}
		if errors.Is(err, schemas.ErrConflict) {
			if _, gerr := c.Session.Get(ctx, ns, key); errors.Is(gerr, schemas.ErrNotFound) {
				err = nil // gone already (an attempt before a crash removed it)
			}
		}
		if err != nil {
			return nil, bad(err)
		}
		return map[string]any{"deleted": true}, nil
	}
	es, err := c.Session.List(ctx, ns)
	if err != nil {
		return nil, bad(err)
	}
	out := []map[string]any{}
	for _, e := range es {
		out = append(out, map[string]any{"key": e.Key, "value": e.Value, "revision": e.Revision})
	}
	return map[string]any{"entries": out}, nil
}
