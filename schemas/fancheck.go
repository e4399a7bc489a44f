package schemas

import (
	"fmt"
	"slices"
	"text/template"
	"text/template/parse"
)

// checkFans reports what is wrong with the parallel and for_each steps of
// d: branches that are not steps, are reached from elsewhere, or could
// write the same state path; joins on steps that are not parallel; maps
// over a path the state schema says is not a list, and item keys that
// cannot tell items apart.
func checkFans(d *Definition) []Problem {
	var ps []Problem
	add := func(path, format string, args ...any) {
		ps = append(ps, Problem{Path: path, Message: fmt.Sprintf(format, args...)})
	}
	// Where each step is reached from: a transition, on_error, start.
	reached := map[string]string{d.StartStep(): "/start"}
	for i, s := range d.Steps {
		for j, t := range s.Next {
			if t.To != "" {
				reached[t.To] = fmt.Sprintf("/steps/%d/next/%d/to", i, j)
			}
		}
		if s.OnError != "" {
			reached[s.OnError] = fmt.Sprintf("/steps/%d/on_error", i)
		}
	}
	branchOf := map[string]string{}
	for i, s := range d.Steps {
		base := fmt.Sprintf("/steps/%d", i)
		if s.Kind != KindParallel {
			if len(s.Branches) > 0 {
				add(base+"/branches", "only a step of kind parallel has branches (this one is %s)", s.Kind)
			}
			if s.Join != nil {
				add(base+"/join", "only a step of kind parallel has a join (this one is %s)", s.Kind)
			}
		} else {
			if len(s.Branches) == 0 {
				add(base+"/branches", "a parallel step needs at least one branch")
			}
			if s.ForEach != nil {
				add(base+"/for_each", "a parallel step cannot also be a for_each step; map in a step before or after it")
			}
			savedBy := map[string]string{}
			for j, b := range s.Branches {
				bp := fmt.Sprintf("%s/branches/%d", base, j)
				bs := d.Step(b)
				switch {
				case bs == nil:
					add(bp, "branch %q is not a step of this workflow", b)
					continue
				case b == s.ID:
					add(bp, "a parallel step cannot be its own branch")
					continue
				case branchOf[b] != "":
					add(bp, "step %q is already a branch of parallel step %q", b, branchOf[b])
					continue
				}
				branchOf[b] = s.ID
				if from, ok := reached[b]; ok {
					add(bp, "branch %q is also reached from %s; a branch runs only from its parallel step", b, PointerToPath(from))
				}
				if bs.Kind == KindParallel || bs.ForEach != nil {
					// (a workflow branch is fine: a child job runs the chain)
					add(bp, "branch %q is itself a parallel or for_each step, which a branch cannot be", b)
				}
				if len(bs.Next) > 0 || bs.OnError != "" {
					add(bp, "branch %q has next or on_error; the join of %q decides what follows", b, s.ID)
				}
				if bs.SaveAs == "" {
					add(bp, "branch %q has no save_as: parallel branches merging their outputs at the top level could write the same path", b)
				} else if other, dup := savedBy[bs.SaveAs]; dup {
					add(bp, "branches %q and %q both write state.%s", other, b, bs.SaveAs)
				} else {
					savedBy[bs.SaveAs] = b
				}
			}
			if j := s.Join; j != nil {
				switch {
				case j.ModeOf() == JoinN && (j.N < 1 || j.N > len(s.Branches)):
					add(base+"/join/n", "join mode n needs n between 1 and the %d branches, not %d", len(s.Branches), j.N)
				case j.ModeOf() != JoinN && j.N != 0:
					add(base+"/join/n", "n is only for join mode n (this one is %s)", j.ModeOf())
				}
			}
			if len(s.With) > 0 {
				add(base+"/with", "a parallel step has no settings of its own; its branches do")
			}
			if b, dup := savedBy[s.SaveAs]; s.SaveAs != "" && dup {
				add(base+"/save_as", "the parallel step and its branch %q both write state.%s", b, s.SaveAs)
			}
		}
		if s.Kind == KindWorkflow {
			if cs, err := ChildOf(&d.Steps[i]); err == nil {
				if cs.Workflow == d.Name {
					add(base+"/with/workflow", "a workflow step cannot start its own workflow %q: each child would start another, without end", d.Name)
				}
				if cs.Input != "" {
					if sh := statePathShape(d, cs.Input); sh != nil && sh.Type != "" && sh.Type != "object" {
						add(base+"/with/input", "state.%s is %s by the workflow's schema; a child's input is an object", cs.Input, sh.Type)
					}
				}
			} else {
				add(base+"/with", "%v", err)
			}
		}
		if f := s.ForEach; f != nil {
			if s.Kind == KindWorkflow {
				add(base+"/for_each", "a workflow step cannot be a map (one child job per item is not supported); map inside the child workflow instead")
			}
			if s.SaveAs == "" {
				add(base+"/save_as", "a for_each step needs save_as: its outputs are gathered as a list there")
			}
			if s.IdempotencyKey != "" {
				add(base+"/idempotency_key", "a for_each step names its items with for_each.key; each item's idempotency key is derived from it")
			}
			if sh := statePathShape(d, f.Items); sh != nil && sh.Type != "" && sh.Type != "array" {
				add(base+"/for_each/items", "state.%s is %s by the workflow's schema, not a list", f.Items, sh.Type)
			}
			if f.Key != "" {
				t, err := template.New(s.ID + ".for_each.key").Option("missingkey=error").Funcs(effectKeyFuncs()).Parse(f.Key)
				if err != nil {
					add(base+"/for_each/key", "%v", err)
				} else {
					fields := topFields(t.Tree.Root)
					other := slices.IndexFunc(fields, func(f string) bool { return f != "item" && f != "index" })
					switch {
					case !slices.Contains(fields, "item") && !slices.Contains(fields, "index"):
						add(base+"/for_each/key", "key %q reads neither .item nor .index, so every item would get the same key", f.Key)
					case other >= 0:
						add(base+"/for_each/key", "key %q reads .%s; a key sees only .item and .index", f.Key, fields[other])
					}
				}
			}
		}
	}
	return ps
}

// statePathShape returns the shape the state schema (or, without one, the
// input schema) gives the dotted path; nil when it says nothing.
func statePathShape(d *Definition, path string) *Shape {
	raw := d.StateSchema
	if len(raw) == 0 {
		raw = d.InputSchema
	}
	return ShapeOf(raw).At(path)
}

// topFields returns the top-level fields a template tree reads ("item"
// for {{.item.id}}), in the order met.
func topFields(n parse.Node) []string {
	var out []string
	var walk func(parse.Node)
	walk = func(n parse.Node) {
		switch n := n.(type) {
		case *parse.ListNode:
			if n != nil {
				for _, c := range n.Nodes {
					walk(c)
				}
			}
		case *parse.ActionNode:
			walk(n.Pipe)
		case *parse.PipeNode:
			if n != nil {
				for _, c := range n.Cmds {
					walk(c)
				}
			}
		case *parse.CommandNode:
			for _, a := range n.Args {
				walk(a)
			}
		case *parse.FieldNode:
			if len(n.Ident) > 0 {
				out = append(out, n.Ident[0])
			}
		case *parse.IfNode:
			walk(n.Pipe)
			walk(n.List)
			walk(n.ElseList)
		case *parse.RangeNode:
			walk(n.Pipe)
			walk(n.List)
			walk(n.ElseList)
		case *parse.WithNode:
			walk(n.Pipe)
			walk(n.List)
			walk(n.ElseList)
		}
	}
	walk(n)
	return out
}

// ParseItemKey parses a for_each key template (text/template,
// missingkey=error) over .item and .index, with the functions of
// idempotency_key templates; nil for an empty text.
func ParseItemKey(stepID, text string) (*template.Template, error) {
	if text == "" {
		return nil, nil
	}
	t, err := template.New(stepID + ".for_each.key").Option("missingkey=error").Funcs(effectKeyFuncs()).Parse(text)
	if err != nil {
		return nil, fmt.Errorf("for_each.key of step %s: %w", stepID, err)
	}
	return t, nil
}
