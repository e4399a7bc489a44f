package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	jsonpatch "github.com/evanphx/json-patch/v5"

	"github.com/waymark-dev/waymark/schemas"
)

// MigrateRequest moves a job to another definition of its workflow. To is
// a definition hash (64 hex digits), the workflow's name (the definition
// stored last) or "name@version" (that version, when it is the one
// stored last); Patch is a JSON Patch (RFC 6902) applied to the job's
// state first, or empty for none.
type MigrateRequest struct {
	// Definition, when set, is the definition to move to (a workflow file
	// the caller loaded): stored only once the migration passed its checks.
	Definition *schemas.Definition `json:"-"`
	To         string              `json:"to"`
	Patch      json.RawMessage     `json:"patch,omitempty"`
	By         string              `json:"by"`
	Reason     string              `json:"reason,omitempty"`
}

// ErrMigration: the migration was refused; nothing changed. The error
// says why: the state after the patch breaks the new state schema (with
// the JSON pointer of each problem), a patch that does not apply (its
// operation), a step the job is at that the new definition lacks.
var ErrMigration = errors.New("migration refused")

// Migrate moves job id to the definition r.To names, with its state
// patched by r.Patch and checked against that definition's state schema
// before anything runs; the engine records it (job.migrated) and the job
// goes on under the new definition: a job blocked on a definition that
// cannot be loaded goes back to what it was doing. The job must have
// failed, wait for approval, be blocked on its definition, or be paused
// with nothing in flight, and not be in a parallel, map or agent step.
// Errors: schemas.ErrNotFound (the job, the definition); ErrNotApplicable;
// ErrMigration (with the reasons); CodeInputInvalid for a bad To or
// patch; ErrControlPending.
func (c *Client) Migrate(ctx context.Context, id string, r MigrateRequest) (*JobView, error) {
	if err := checkWho("migrate", id, ControlRequest{By: r.By, Reason: r.Reason}); err != nil {
		return nil, err
	}
	cp, err := c.load(ctx, "migrate", id)
	if err != nil {
		return nil, err
	}
	if !cp.Migratable() {
		return nil, fmt.Errorf("migrate job %s: it is %s%s; migrate a job that failed, waits for approval, is blocked on its definition, or is paused with nothing in flight (engine pause %s), outside parallel, map and agent steps: %w",
			id, cp.Status, map[bool]string{true: " (paused, a step in flight)", false: ""}[cp.Paused != nil], id, ErrNotApplicable)
	}
	def := r.Definition
	if def == nil {
		if def, err = c.resolveDefinition(ctx, cp.Workflow, r.To); err != nil {
			return nil, fmt.Errorf("migrate job %s: %w", id, err)
		}
	} else if def.Name != cp.Workflow {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "migrate job %s: the file defines workflow %s; the job's is %s", id, def.Name, cp.Workflow)
	}
	if def.Hash == cp.DefinitionHash && len(r.Patch) == 0 {
		return nil, fmt.Errorf("migrate job %s: it runs definition %s already, and no patch is given: %w", id, short(def.Hash), ErrNotApplicable)
	}
	state := cp.State
	if schemas.HasRefs(state) {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "migrate job %s: its state holds values by reference (large values), which a migration cannot patch yet", id)
	}
	if len(r.Patch) > 0 {
		patch, err := jsonpatch.DecodePatch(r.Patch)
		if err != nil {
			return nil, schemas.Errorf(schemas.CodeInputInvalid, "migrate job %s: the patch is not a JSON Patch (RFC 6902): %v", id, err)
		}
		if state, err = patch.Apply(state); err != nil {
			return nil, fmt.Errorf("migrate job %s: the patch does not apply to the job's state: %v: %w", id, err, ErrMigration)
		}
	}
	v, err := c.compile(def)
	if err != nil {
		return nil, err
	}
	if v.state != nil {
		var doc any
		if err := json.Unmarshal(state, &doc); err != nil {
			return nil, fmt.Errorf("migrate job %s: the patched state is not JSON: %v: %w", id, err, ErrMigration)
		}
		if err := v.state.Validate(doc); err != nil {
			return nil, fmt.Errorf("migrate job %s: the state breaks the state schema of definition %s (v%d): %v: %w", id, short(def.Hash), def.Version, err, ErrMigration)
		}
	}
	if cur := cp.Current; cur != nil && def.Step(cur.Step) == nil {
		return nil, fmt.Errorf("migrate job %s: it is at step %s, which definition %s (v%d) does not have: %w", id, cur.Step, short(def.Hash), def.Version, ErrMigration)
	}
	if r.Definition != nil {
		if err := c.store.Definitions.Put(ctx, r.Definition); err != nil {
			return nil, fmt.Errorf("migrate job %s: store definition %s: %w", id, short(def.Hash), err)
		}
	}
	// Seq: the checkpoint the patch was applied to; a migration that finds
	// the job moved on is dropped, and its sender told.
	sig := schemas.Signal{Job: id, Type: schemas.SignalMigrate, By: r.By, Reason: r.Reason, Definition: def.Hash, State: state, Seq: cp.Seq}
	return c.control(ctx, "migrate", cp, sig, func(n *schemas.Checkpoint) bool {
		return n.Seq > cp.Seq || !n.Migratable()
	})
}

// resolveDefinition finds the definition to of workflow: a hash, the
// workflow's name, or name@version.
func (c *Client) resolveDefinition(ctx context.Context, workflow, to string) (*schemas.Definition, error) {
	switch {
	case to == "":
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "say which definition to move to: a hash, %s, or %s@VERSION", workflow, workflow)
	case len(to) == 64 && isDigest(to):
		def, err := c.store.Definitions.Get(ctx, to)
		if err != nil {
			return nil, fmt.Errorf("definition %s: %w", short(to), err)
		}
		if def.Name != workflow {
			return nil, schemas.Errorf(schemas.CodeInputInvalid, "definition %s is of workflow %s, not %s", short(to), def.Name, workflow)
		}
		return def, nil
	}
	name, version, hasVersion := strings.Cut(to, "@")
	if name != workflow {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "%q names workflow %s; the job's is %s", to, name, workflow)
	}
	def, err := c.store.Definitions.Latest(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("workflow %s: %w", name, err)
	}
	if hasVersion {
		n, err := strconv.Atoi(version)
		if err != nil {
			return nil, schemas.Errorf(schemas.CodeInputInvalid, "%q: the version is a number", to)
		}
		if def.Version != n {
			return nil, schemas.Errorf(schemas.CodeInputInvalid, "%q: the definition of %s stored last is v%d (%s); give the hash of v%d", to, name, def.Version, short(def.Hash), n)
		}
	}
	return def, nil
}
