package schemas

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"text/template"
)

// IdempotencyKey derives the key of one logical action: the run-th run of
// step in job ("<job>/<step>", "<job>/<step>/run-N" from the second run).
// Every attempt of that run carries the same key; nothing else ever does.
func IdempotencyKey(job, step string, run int) string {
	if run <= 1 {
		return job + "/" + step
	}
	return job + "/" + step + "/run-" + strconv.Itoa(run)
}

// effectKeyFuncs are what an idempotency_key template may call. None reads
// the clock or a secret: a key must come out the same on every attempt,
// and it is stored (in the ledger, the checkpoint and the history).
func effectKeyFuncs() template.FuncMap {
	return template.FuncMap{
		"json":  TemplateJSON,
		"lower": strings.ToLower,
		"upper": strings.ToUpper,
		"trim":  strings.TrimSpace,
	}
}

// ParseEffectKey parses a step's idempotency_key template (text/template,
// missingkey=error). It sees .state, .vars, .job, .step and
// .idempotency_key (the key derived from the job), and the functions json,
// lower, upper and trim; never an attempt number, the clock or a secret.
// Empty text gives nil: the step uses the derived key.
func ParseEffectKey(stepID, text string) (*template.Template, error) {
	if text == "" {
		return nil, nil
	}
	t, err := template.New(stepID + ".idempotency_key").Option("missingkey=error").Funcs(effectKeyFuncs()).Parse(text)
	if err != nil && strings.Contains(err.Error(), `function "secret" not defined`) {
		return nil, fmt.Errorf("template %s.idempotency_key: {{secret}} is not allowed here: an idempotency key is stored (in the ledger, the checkpoint and the history) and sent in the clear", stepID)
	}
	if err != nil {
		return nil, fmt.Errorf("idempotency_key: %w", err)
	}
	return t, nil
}

// EffectKey is the ledger key of the run-th run of step in job: the
// derived IdempotencyKey of base (the job's Checkpoint.KeyBase), or, when the step names its action with an
// idempotency_key template (tmpl, from ParseEffectKey), the workflow, the
// step and a digest of the rendered text ("<workflow>/<step>/k-<digest>"),
// so that two jobs naming the same action share one record. state is the
// job's state as JSON. Errors: the template fails or renders empty.
func EffectKey(def *Definition, step *Step, job, base string, run int, tmpl *template.Template, state json.RawMessage, vars map[string]string) (string, error) {
	derived := IdempotencyKey(base, step.ID, run)
	if tmpl == nil {
		return derived, nil
	}
	var doc map[string]any
	if len(state) > 0 {
		if err := json.Unmarshal(state, &doc); err != nil {
			return "", fmt.Errorf("idempotency_key of step %s: decode state: %w", step.ID, err)
		}
	}
	if doc == nil {
		doc = map[string]any{}
	}
	var b strings.Builder
	data := map[string]any{"state": doc, "vars": vars, "job": job, "step": step.ID, "idempotency_key": derived}
	if err := tmpl.Execute(&b, data); err != nil {
		return "", fmt.Errorf("idempotency_key of step %s: %w", step.ID, err)
	}
	if b.Len() == 0 {
		return "", fmt.Errorf("idempotency_key of step %s rendered empty", step.ID)
	}
	sum := sha256.Sum256([]byte(b.String()))
	return def.Name + "/" + step.ID + "/k-" + hex.EncodeToString(sum[:16]), nil
}

// checkEffectKeys reports idempotency_key templates that do not parse.
func checkEffectKeys(d *Definition) []Problem {
	var ps []Problem
	for i, s := range d.Steps {
		if _, err := ParseEffectKey(s.ID, s.IdempotencyKey); err != nil {
			ps = append(ps, Problem{Path: fmt.Sprintf("/steps/%d/idempotency_key", i), Message: err.Error()})
		}
	}
	return ps
}

// TemplateJSON is the json function of step and key templates: v as
// compact JSON without HTML escaping and without a trailing newline.
// It returns the encoder's error for a value JSON cannot hold.
func TemplateJSON(v any) (string, error) {
	b, err := Marshal(v)
	return string(b), err
}

// Marshal is json.Marshal without HTML escaping: '<', '>' and '&' stay one
// byte each instead of six (\u003c), so that text holding HTML is not
// stored, sent and limited at six times its size. It returns the
// encoder's error for a value JSON cannot hold.
func Marshal(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimRight(b.Bytes(), "\n"), nil
}
