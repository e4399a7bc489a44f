package engine

import (
	"encoding/json"
	"fmt"
	"sync"
	"text/template"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/vm"
	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/waymark-dev/waymark/schemas"
)

// compiled is what the engine needs of a definition, prepared once per
// hash: schema validators and transition programs.
type compiled struct {
	def    *schemas.Definition
	input  *schemas.Validator
	state  *schemas.Validator
	output []*schemas.Validator // by step index
	next   [][]transition       // by step index
	keys   []*template.Template // by step index: the idempotency_key template, if any
	// needsDoc reports, by step index, whether deciding after the step
	// needs the decoded state (a condition, or a state schema).
	needsDoc []bool
}

type transition struct {
	schemas.Transition
	prog *vm.Program // nil when When is empty
}

// conditionOptions fixes what a transition condition may use. now() is
// disabled so that evaluating the same condition again, after a crash,
// takes the same branch.
func conditionOptions() []expr.Option {
	return []expr.Option{
		expr.Env(conditionEnv{}),
		expr.AsBool(),
		expr.DisableBuiltin("now"),
	}
}

// conditionEnv documents the names a condition sees. The values are plain
// JSON (maps, slices, float64, string, bool, nil).
type conditionEnv struct {
	State   any               `expr:"state"`   // the job's state after the step's output was merged
	Output  any               `expr:"output"`  // the step's output
	Vars    map[string]string `expr:"vars"`    // the job's pinned vars
	Step    string            `expr:"step"`    // the step that just completed
	Attempt int               `expr:"attempt"` // its attempt number within the run
}

// Check reports transition conditions that do not compile, for the
// definition loader (schemas.LoadOptions.Checks).
func Check(def *schemas.Definition) []schemas.Problem {
	var ps []schemas.Problem
	for i, s := range def.Steps {
		for j, t := range s.Next {
			if t.When == "" {
				continue
			}
			if _, err := expr.Compile(t.When, conditionOptions()...); err != nil {
				ps = append(ps, schemas.Problem{
					Path:    fmt.Sprintf("/steps/%d/next/%d/when", i, j),
					Message: fmt.Sprintf("condition does not compile: %v", err),
				})
			}
		}
	}
	return ps
}

func compile(def *schemas.Definition) (*compiled, error) {
	c := &compiled{
		def:      def,
		output:   make([]*schemas.Validator, len(def.Steps)),
		next:     make([][]transition, len(def.Steps)),
		needsDoc: make([]bool, len(def.Steps)),
		keys:     make([]*template.Template, len(def.Steps)),
	}
	var err error
	if c.input, err = schemas.CompileSchema("input_schema", def.InputSchema); err != nil {
		return nil, err
	}
	if c.state, err = schemas.CompileSchema("state_schema", def.StateSchema); err != nil {
		return nil, err
	}
	for i, s := range def.Steps {
		if c.output[i], err = schemas.CompileSchema(fmt.Sprintf("steps[%d].output_schema", i), s.OutputSchema); err != nil {
			return nil, err
		}
		c.needsDoc[i] = c.state != nil
		if c.keys[i], err = schemas.ParseEffectKey(s.ID, s.IdempotencyKey); err != nil {
			return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d]: %v", i, err)
		}
		for j, t := range s.Next {
			tr := transition{Transition: t}
			if t.When != "" {
				tr.prog, err = expr.Compile(t.When, conditionOptions()...)
				if err != nil {
					return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d].next[%d].when: %v", i, j, err)
				}
				c.needsDoc[i] = true
			}
			c.next[i] = append(c.next[i], tr)
		}
	}
	return c, nil
}

// compiledCache holds compiled definitions by hash. Definitions are
// immutable, so entries never go stale.
type compiledCache struct {
	mu    sync.Mutex
	cache *lru.Cache[string, *compiled]
}

func newCompiledCache(size int) *compiledCache {
	c, _ := lru.New[string, *compiled](size)
	return &compiledCache{cache: c}
}

func (cc *compiledCache) get(def *schemas.Definition) (*compiled, error) {
	if c, ok := cc.cache.Get(def.Hash); ok {
		return c, nil
	}
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if c, ok := cc.cache.Get(def.Hash); ok {
		return c, nil
	}
	c, err := compile(def)
	if err != nil {
		return nil, fmt.Errorf("compile definition %s@%d: %w", def.Name, def.Version, err)
	}
	cc.cache.Add(def.Hash, c)
	return c, nil
}

// decodePlain decodes JSON into plain values (float64 numbers) for
// conditions and validation. Empty input gives nil.
func decodePlain(raw json.RawMessage) (any, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, err
	}
	return v, nil
}
