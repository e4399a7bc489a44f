// Package steps is what workers run: the step kinds (model, http, noop and
// any a custom worker registers), the worker runtime that pulls step
// messages from a pool's work consumer, and the template helpers kinds
// share.
//
// One attempt of one step, as a worker sees it:
//
//	pull step message ─► hold until not_before ─► validate state against the
//	step's input_schema ─► run the kind (heartbeats extend the lease) ─►
//	validate output against output_schema ─► publish the result to the
//	engine's inbox (dedup id <job>/<step>/<attempt>/result) ─► ack
//
// The step message is acknowledged only after its result is durably in
// the inbox: a worker that dies before that leaves the message to be
// delivered again after the ack wait.
//
// Credentials reach a step only as references ({{secret "NAME"}} in an
// http step's request, api_key_secret in a model step), resolved by the
// worker when it makes the call (secrets.go); whatever the call produces is
// scrubbed of the values it resolved before it is recorded, published or
// logged (scrub.go). An http step's body is a JSON value whose string
// leaves are templates, so data cannot add structure to it (body.go).
//
// A custom worker registers its own kinds and runs the same runtime:
//
//	reg := steps.NewRegistry()
//	reg.Register("enrich", steps.Func(func(ctx context.Context, c *steps.Call) (any, error) {
//		return map[string]any{"score": 0.9}, nil
//	}))
//	w, err := steps.NewWorker(steps.WorkerConfig{Store: store, Registry: reg})
//	...
//	err = w.Run(ctx)
package steps
