package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/engine/notify"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// runEngine runs cfg's jobs through Waymark: an engine and a worker in
// this process, jobs started through the Client as users start them.
func runEngine(ctx context.Context, cfg Config, tg *target, rec *recorder) error {
	nc, js, err := tg.connect("bench")
	if err != nil {
		return err
	}
	defer nc.Close()
	store, err := kv.Open(ctx, js, kv.Config{QueueStorage: cfg.Queues, Replicas: tg.replicas, GroupCommit: cfg.GroupCommit == "on" || (cfg.GroupCommit == "" && cfg.Sync == natsserver.SyncAlways)}, cfg.Logger)
	if err != nil {
		return err
	}
	if st, err := js.Stream(ctx, "KV_"+store.Names.CheckpointBucket); err == nil {
		rec.replicas.Store(int64(st.CachedInfo().Config.Replicas))
	}
	env := &steps.Env{ModelMode: steps.ModelReplay}
	if cfg.Kind == "http" {
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"ok": true}`))
		}))
		defer hs.Close()
		env.Services = map[string]string{"bench": hs.URL}
	}
	def, err := benchDefinition(cfg)
	if err != nil {
		return err
	}
	slots := make(chan struct{}, cfg.Concurrency)
	sz := newSizer()
	// Registered before the engine's and worker's stop below, so it runs
	// after them: no checkpoint is written once the sizer is closed.
	defer func() { rec.cpAny.Store(sz.close()) }()
	e, err := engine.New(engine.Config{Store: store, Logger: cfg.Logger, ReconcileInterval: -1,
		HistoryBatch: cfg.HistoryBatch, CacheBytes: cfg.CacheBytes, Lanes: cfg.Lanes,
		OnWrite: func(cp *schemas.Checkpoint) {
			sz.add(cp)
			if cp.Seq < 2 {
				return
			}
			final := cp.Status.Terminal()
			if final {
				storeMax(&rec.cpMax, int64(len(cp.AppendJSON(nil))))
				if cp.Status != schemas.JobCompleted {
					what := fmt.Sprintf("job %s %s", cp.JobID, cp.Status)
					if cp.Error != nil {
						what += ": " + cp.Error.Message
					}
					rec.jobFailed(what)
				} else if cfg.Shape != ShapeChain {
					rec.counted.Add(int64(countSteps(cfg, cp.State)))
				}
			}
			// A map's or parallel step's checkpoint write carries several
			// steps, or none: only the job's latency is recorded.
			if final || cfg.Shape == ShapeChain {
				rec.stepDone(cp.JobID, final)
			}
			if final {
				<-slots
			}
		}})
	if err != nil {
		return err
	}
	w, err := steps.NewWorker(steps.WorkerConfig{Store: store, Env: env, Concurrency: cfg.Workers, Logger: cfg.Logger})
	if err != nil {
		return err
	}
	runs := []func(context.Context) error{e.Run, w.Run}
	if cfg.Events {
		r, err := notify.NewRelay(notify.RelayConfig{Store: store, Logger: cfg.Logger})
		if err != nil {
			return err
		}
		runs = append(runs, r.Run)
	}
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for _, run := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = run(rctx)
		}()
	}
	cl := client.New(store)
	input := benchInput(cfg)
	errs := make(chan error, 1)
	go feed(rctx, cfg, slots, func(job string) error {
		rec.began(job)
		if _, err := cl.Start(rctx, def, input, client.StartOptions{JobID: job}); err != nil {
			select {
			case errs <- err:
			default:
			}
			cancel()
			return err
		}
		return nil
	})
	defer func() {
		c := store.Checkpoints.GroupCommitCounts()
		rec.commits.Store(c.Batches)
		rec.committed.Store(c.Batched)
	}()
	if err := rec.wait(rctx); err != nil {
		select {
		case e := <-errs:
			return e
		default:
		}
		return err
	}
	return nil
}

// benchInput is a job's input: the payload, and for a map the list of
// items, {"n": i} each.
func benchInput(cfg Config) []byte {
	payload := strings.Repeat("x", cfg.Payload)
	if cfg.StateValues > 1 {
		// v1..vN, each a different value (the value store keeps one copy
		// of equal values).
		each := cfg.Payload / cfg.StateValues
		m := map[string]string{}
		for i := 1; i <= cfg.StateValues; i++ {
			m["v"+strconv.Itoa(i)] = strconv.Itoa(i) + strings.Repeat("x", max(each-len(strconv.Itoa(i)), 0))
		}
		input, _ := json.Marshal(m)
		return input
	}
	if cfg.Shape != ShapeMap {
		input, _ := json.Marshal(map[string]string{"payload": payload})
		return input
	}
	b := []byte(`{"payload":`)
	b = strconv.AppendQuote(b, payload)
	b = append(b, `,"items":[`...)
	for i := range cfg.Items {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"n":`...)
		b = strconv.AppendInt(b, int64(i), 10)
		b = append(b, '}')
	}
	return append(b, "]}"...)
}

// countSteps counts the steps a completed job of a map or parallel shape
// ran from its final state: the outputs the map gathered under "out", or
// the parallel job's branch outputs ("b1".."bN") and the step after's
// ("after").
func countSteps(cfg Config, state json.RawMessage) int {
	var st map[string]json.RawMessage
	if json.Unmarshal(state, &st) != nil {
		return 0
	}
	if cfg.Shape == ShapeMap {
		var outs []json.RawMessage
		if json.Unmarshal(st["out"], &outs) != nil {
			return 0
		}
		return len(outs)
	}
	if cfg.Shape == ShapeAgent {
		var out schemas.AgentOutput
		if json.Unmarshal(st["out"], &out) != nil {
			return 0
		}
		return out.Turns + out.ToolCalls
	}
	n := 0
	for i := 1; i <= cfg.Branches; i++ {
		if _, ok := st["b"+strconv.Itoa(i)]; ok {
			n++
		}
	}
	if _, ok := st["after"]; ok {
		n++
	}
	return n
}

// storeMax raises v to n if n is larger.
func storeMax(v *atomic.Int64, n int64) {
	for old := v.Load(); n > old && !v.CompareAndSwap(old, n); old = v.Load() {
	}
}

// sizer measures the encoding of every checkpoint the engine writes, on a
// goroutine of its own so that the engine's lanes do not pay for it (a
// map's checkpoint holds its list). Checkpoints are not changed once
// written (the engine decides on a copy), so reading them later is safe.
// When its queue is full a checkpoint is measured at once.
type sizer struct {
	ch      chan *schemas.Checkpoint
	largest atomic.Int64
	done    chan struct{}
}

func newSizer() *sizer {
	s := &sizer{ch: make(chan *schemas.Checkpoint, 1<<14), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		var buf []byte
		for cp := range s.ch {
			buf = cp.AppendJSON(buf[:0])
			storeMax(&s.largest, int64(len(buf)))
		}
	}()
	return s
}

// add measures cp, later or now.
func (s *sizer) add(cp *schemas.Checkpoint) {
	select {
	case s.ch <- cp:
	default:
		storeMax(&s.largest, int64(len(cp.AppendJSON(nil))))
	}
}

// close measures what is queued and returns the largest size seen; add
// must not be called again.
func (s *sizer) close() int64 {
	close(s.ch)
	<-s.done
	return s.largest.Load()
}

// benchDefinition is cfg's workflow: a chain of cfg.Steps steps of
// cfg.Kind, or a map or parallel job of no-op steps.
func benchDefinition(cfg Config) (*schemas.Definition, error) {
	var b strings.Builder
	b.WriteString("name: bench\nversion: 1\n")
	switch cfg.Shape {
	case ShapeMap:
		fmt.Fprintf(&b, "steps:\n  - id: each\n    kind: noop\n    save_as: out\n    for_each: {items: items, concurrency: %d}\n", cfg.ItemConcurrency)
		return parseBench(b.String(), "")
	case ShapeParallel:
		b.WriteString("steps:\n  - id: fan\n    kind: parallel\n    branches: [")
		for i := 1; i <= cfg.Branches; i++ {
			if i > 1 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "b%d", i)
		}
		b.WriteString("]\n    next: [{to: after}]\n")
		for i := 1; i <= cfg.Branches; i++ {
			fmt.Fprintf(&b, "  - {id: b%d, kind: noop, save_as: b%d}\n", i, i)
		}
		b.WriteString("  - {id: after, kind: noop, save_as: after}\n")
		return parseBench(b.String(), "")
	}
	dir := ""
	if cfg.Shape == ShapeAgent {
		d, err := os.MkdirTemp("", "waymark-bench-def-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		var inter []map[string]any
		for i := 1; i <= cfg.Turns; i++ {
			reply := map[string]any{"text": "done", "usage": map[string]int{"input_tokens": 1000 * i, "output_tokens": 50}}
			if i < cfg.Turns {
				reply = map[string]any{"text": "", "usage": map[string]int{"input_tokens": 1000 * i, "output_tokens": 50},
					"tool_calls": []map[string]any{{"id": fmt.Sprintf("call_%d", i), "name": "look", "input": map[string]int{"n": i}}}}
			}
			inter = append(inter, map[string]any{"step": "agent", "turn": i, "replies": []map[string]any{reply}})
		}
		data, _ := json.Marshal(map[string]any{"version": 1, "interactions": inter})
		if err := os.WriteFile(filepath.Join(d, "cassette.json"), data, 0o600); err != nil {
			return nil, err
		}
		fmt.Fprintf(&b, "assets: {cassette: cassette.json}\nsteps:\n  - id: agent\n    kind: agent\n    save_as: out\n"+
			"    with: {provider: replay, prompt: 'work', cassette: cassette}\n    limits: {max_turns: %d}\n"+
			"    tools: [{name: look, kind: noop, effect: pure, input_schema: {type: object}}]\n", cfg.Turns)
		return parseBench(b.String(), d)
	}
	if cfg.Kind == "model" {
		d, err := os.MkdirTemp("", "waymark-bench-def-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		dir = d
		var inter []map[string]any
		for i := 1; i <= cfg.Steps; i++ {
			inter = append(inter, map[string]any{"step": fmt.Sprintf("s%d", i), "replies": []map[string]any{{"text": `{"ok": true}`}}})
		}
		data, _ := json.Marshal(map[string]any{"version": 1, "interactions": inter})
		if err := os.WriteFile(filepath.Join(dir, "cassette.json"), data, 0o600); err != nil {
			return nil, err
		}
		b.WriteString("assets: {cassette: cassette.json}\n")
	}
	b.WriteString("steps:\n")
	for i := 1; i <= cfg.Steps; i++ {
		fmt.Fprintf(&b, "  - id: s%d\n    kind: %s\n", i, cfg.Kind)
		switch cfg.Kind {
		case "http":
			b.WriteString("    with: {method: POST, url: '{{service \"bench\"}}/step', body: '{}'}\n    save_as: last\n")
		case "model":
			b.WriteString("    with: {provider: replay, prompt: 'step {{.step}}', cassette: cassette}\n    save_as: last\n")
		}
		if cfg.StepConcurrency > 0 {
			fmt.Fprintf(&b, "    concurrency: {limit: %d}\n", cfg.StepConcurrency)
		}
		if i < cfg.Steps {
			fmt.Fprintf(&b, "    next: [{to: s%d}]\n", i+1)
		}
	}
	return parseBench(b.String(), dir)
}

func parseBench(yaml, dir string) (*schemas.Definition, error) {
	return schemas.Parse("bench.yaml", []byte(yaml), schemas.LoadOptions{BaseDir: dir,
		Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().Check(&steps.Env{ModelMode: steps.ModelReplay}, schemas.KindParallel)}})
}
