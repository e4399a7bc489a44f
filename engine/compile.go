package engine

import (
	"encoding/json"
	"fmt"
	"reflect"
	"sync"
	"text/template"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/types"
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
	// actions: by step index, the approval action template, if any.
	actions []*template.Template
	// waits: by step index, a wait step's settings, schema and condition.
	waits []*waitStep
	// toolActions: by step index, the approval action templates of an
	// agent step's tools that require approval, by tool name.
	toolActions []map[string]*template.Template
	// itemKeys: by step index, the for_each.key template, if any.
	itemKeys []*template.Template
	// tools: by step index, an agent step's tool input schemas by name.
	tools []map[string]*schemas.Validator
	// env: what fan transitions read besides the checkpoint (the engine's).
	env *fanEnv
	// needsDoc reports, by step index, whether deciding after the step
	// needs the decoded state (a condition, or a state schema).
	needsDoc []bool
	// flow: by step index, the step's flow limits (nil: none); nil for a
	// definition without any.
	flow []*stepFlow
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

// waitStep is a wait step compiled: its settings, the validator of the
// signal's data (nil: any) and its condition (nil: every signal).
type waitStep struct {
	schemas.WaitSettings
	schema *schemas.Validator
	when   *vm.Program
}

// waitEnv documents the names a wait step's condition sees.
type waitEnv struct {
	Data  any               `expr:"data"`  // the signal's data
	State any               `expr:"state"` // the job's state
	Vars  map[string]string `expr:"vars"`
}

func compileWait(i int, s *schemas.Step) (*waitStep, error) {
	set, err := schemas.WaitOf(s)
	if err != nil {
		return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d]: %v", i, err)
	}
	w := &waitStep{WaitSettings: set}
	if w.schema, err = schemas.CompileSchema(fmt.Sprintf("steps[%d].with.schema", i), set.Schema); err != nil {
		return nil, err
	}
	if set.When != "" {
		if w.when, err = expr.Compile(set.When, expr.Env(waitEnv{}), expr.AsBool(), expr.DisableBuiltin("now")); err != nil {
			return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d].with.when: %v", i, err)
		}
	}
	return w, nil
}

// Check reports transition conditions that do not compile, for the
// definition loader (schemas.LoadOptions.Checks). Each condition is also
// type-checked by expr against the shapes the definition declares
// (schemas.StateShape for state, the step's output_schema for output, the
// declared vars): reading a member a closed schema does not have, or a
// condition whose value is not a boolean (it would fail the job after the
// step's side effects, when it is evaluated), is an error. Where the
// schemas leave the value's type open, so that expr cannot tell whether it
// is a boolean, the condition gets a warning instead.
func Check(def *schemas.Definition) []schemas.Problem {
	var ps []schemas.Problem
	var state types.Type
	for i, s := range def.Steps {
		for j, t := range s.Next {
			if t.When == "" {
				continue
			}
			ptr := fmt.Sprintf("/steps/%d/next/%d/when", i, j)
			if _, err := expr.Compile(t.When, conditionOptions()...); err != nil {
				ps = append(ps, schemas.Problem{Path: ptr, Message: fmt.Sprintf("condition does not compile: %v", err)})
				continue
			}
			if state == nil {
				state = exprType(schemas.StateShape(def))
			}
			prog, err := expr.Compile(t.When, typedConditionOptions(def, state, schemas.OutputShapeOf(&s))...)
			switch {
			case err != nil:
				ps = append(ps, schemas.Problem{Path: ptr, Message: fmt.Sprintf("condition does not type-check against the declared schemas (state_schema, the step's output_schema, vars): %v", err)})
			case prog.Node().Type() == nil || prog.Node().Type().Kind() == reflect.Interface:
				ps = append(ps, schemas.Problem{Path: ptr, Warning: true, Message: "cannot check that this condition gives a boolean: it reads values whose type the schemas leave open; " +
					"anything else fails the job when the condition is evaluated"})
			}
		}
		if s.Kind == schemas.KindWait {
			if w, err := schemas.WaitOf(&def.Steps[i]); err == nil && w.When != "" {
				if _, err := expr.Compile(w.When, expr.Env(waitEnv{}), expr.AsBool(), expr.DisableBuiltin("now")); err != nil {
					ps = append(ps, schemas.Problem{Path: fmt.Sprintf("/steps/%d/with/when", i), Message: fmt.Sprintf("condition does not compile: %v", err)})
				}
			}
		}
		if set, err := schemas.ApprovalOf(&def.Steps[i]); err == nil && set != nil && set.Scope != nil {
			at := fmt.Sprintf("/steps/%d/with/scope", i)
			if s.Kind != schemas.KindApproval {
				at = fmt.Sprintf("/steps/%d/requires_approval/scope", i)
			}
			if _, err := expr.Compile(set.Scope.When, schemas.ScopeOptions()...); err != nil || set.Scope.When == "" {
				ps = append(ps, schemas.Problem{Path: at + "/when", Message: fmt.Sprintf("scope condition does not compile (it sees request.method, request.url, request.body): %v", err)})
			}
			for j, st := range set.Scope.Steps {
				switch cs := def.Step(st); {
				case cs == nil:
					ps = append(ps, schemas.Problem{Path: fmt.Sprintf("%s/steps/%d", at, j), Message: fmt.Sprintf("scope names step %q, which does not exist", st)})
				case cs.Kind != schemas.KindHTTP:
					ps = append(ps, schemas.Problem{Path: fmt.Sprintf("%s/steps/%d", at, j), Message: fmt.Sprintf("scope names step %q of kind %s; a scope bounds the requests of http steps, which check it before sending", st, cs.Kind)})
				}
			}
			if s.Kind == schemas.KindApproval && len(set.Scope.Steps) == 0 {
				ps = append(ps, schemas.Problem{Path: at + "/steps", Message: "an approval step's scope names the steps it covers (steps: [charge])"})
			}
		}
	}
	return ps
}

// typedConditionOptions are conditionOptions with the environment typed
// from the definition's shapes, for Check only: the programs the engine
// runs are compiled against conditionEnv.
func typedConditionOptions(def *schemas.Definition, state types.Type, output *schemas.Shape) []expr.Option {
	vars := types.Map{}
	for k := range def.Vars {
		vars[k] = types.String
	}
	env := types.Map{
		"state":   state,
		"output":  exprType(output),
		"vars":    vars,
		"step":    types.String,
		"attempt": types.Int,
	}
	return []expr.Option{expr.Env(env), expr.AsBool(), expr.DisableBuiltin("now")}
}

// exprType turns a shape into the expr type of the value a condition sees
// (decoded JSON: numbers are float64). Open objects keep their declared
// members typed and any others as any; a closed one has no others.
func exprType(s *schemas.Shape) types.Type {
	if s == nil {
		return types.Any
	}
	switch {
	case s.IsObject():
		if len(s.Properties) == 0 && !s.Closed {
			return types.Any
		}
		m := types.Map{}
		for k, p := range s.Properties {
			m[k] = exprType(p)
		}
		if !s.Closed {
			m[types.Extra] = exprType(s.Additional)
		}
		return m
	case s.Type == "array":
		return types.Array(exprType(s.Items))
	case s.Type == "string":
		return types.String
	case s.Type == "number", s.Type == "integer":
		return types.Float64
	case s.Type == "boolean":
		return types.Bool
	case s.Type == "null":
		return types.Nil
	}
	return types.Any
}

func compile(def *schemas.Definition) (*compiled, error) {
	c := &compiled{
		def:         def,
		output:      make([]*schemas.Validator, len(def.Steps)),
		next:        make([][]transition, len(def.Steps)),
		needsDoc:    make([]bool, len(def.Steps)),
		keys:        make([]*template.Template, len(def.Steps)),
		actions:     make([]*template.Template, len(def.Steps)),
		waits:       make([]*waitStep, len(def.Steps)),
		toolActions: make([]map[string]*template.Template, len(def.Steps)),
		itemKeys:    make([]*template.Template, len(def.Steps)),
		tools:       make([]map[string]*schemas.Validator, len(def.Steps)),
		env:         newFanEnv(),
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
		if set, err := schemas.ApprovalOf(&def.Steps[i]); err == nil && set != nil {
			if c.actions[i], err = schemas.ParseApprovalAction(s.ID, set.Action); err != nil {
				return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d]: %v", i, err)
			}
		}
		if s.Kind == schemas.KindWait {
			if c.waits[i], err = compileWait(i, &def.Steps[i]); err != nil {
				return nil, err
			}
		}
		for j, t := range s.Tools {
			v, err := schemas.CompileSchema(fmt.Sprintf("steps[%d].tools[%d].input_schema", i, j), t.InputSchema)
			if err != nil {
				return nil, err
			}
			if c.tools[i] == nil {
				c.tools[i] = map[string]*schemas.Validator{}
			}
			c.tools[i][t.Name] = v
			if set := t.RequiresApproval; set != nil && set.Action != "" {
				tmpl, err := schemas.ParseApprovalAction(s.ID+"."+t.Name, set.Action)
				if err != nil {
					return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d].tools[%d]: %v", i, j, err)
				}
				if c.toolActions[i] == nil {
					c.toolActions[i] = map[string]*template.Template{}
				}
				c.toolActions[i][t.Name] = tmpl
			}
		}
		if s.ForEach != nil {
			if c.itemKeys[i], err = schemas.ParseItemKey(s.ID, s.ForEach.Key); err != nil {
				return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d]: %v", i, err)
			}
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
	if c.flow, err = compileFlow(def); err != nil {
		return nil, err
	}
	return c, nil
}

// compiledCache holds compiled definitions by hash. Definitions are
// immutable, so entries never go stale.
type compiledCache struct {
	mu    sync.Mutex
	cache *lru.Cache[string, *compiled]
	env   *fanEnv // given to every definition compiled here
}

func newCompiledCache(size int, env *fanEnv) *compiledCache {
	c, _ := lru.New[string, *compiled](size)
	return &compiledCache{cache: c, env: env}
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
	if cc.env != nil {
		c.env = cc.env
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
