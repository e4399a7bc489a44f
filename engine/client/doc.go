// Package client starts, inspects and steers Waymark jobs from any Go
// program: it stores definitions, creates jobs (validated before anything
// is stored), reads checkpoints and history, lists jobs page by page, and
// settles ambiguous effects. It speaks only to JetStream (through package
// kv) and links neither the engine runtime nor nats-server, as a River
// client does not link a worker:
//
//	st, _ := kv.Open(ctx, js, kv.Config{}, nil)
//	c := client.New(st)
//	res, _ := c.Start(ctx, def, input, client.StartOptions{})
//	view, _ := c.Wait(ctx, res.JobID, nil)
//
// A Client is safe for concurrent use.
package client
