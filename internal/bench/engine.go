package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
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
	e, err := engine.New(engine.Config{Store: store, Logger: cfg.Logger, ReconcileInterval: -1,
		HistoryBatch: cfg.HistoryBatch, CacheBytes: cfg.CacheBytes, Lanes: cfg.Lanes,
		OnWrite: func(cp *schemas.Checkpoint) {
			if cp.Seq < 2 {
				return
			}
			final := cp.Status.Terminal()
			if final {
				n := int64(len(cp.AppendJSON(nil)))
				for old := rec.cpMax.Load(); n > old && !rec.cpMax.CompareAndSwap(old, n); old = rec.cpMax.Load() {
				}
			}
			rec.stepDone(cp.JobID, final)
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
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for _, run := range []func(context.Context) error{e.Run, w.Run} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = run(rctx)
		}()
	}
	cl := client.New(store)
	input, _ := json.Marshal(map[string]string{"payload": strings.Repeat("x", cfg.Payload)})
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

// benchDefinition is a chain of cfg.Steps steps of cfg.Kind.
func benchDefinition(cfg Config) (*schemas.Definition, error) {
	var b strings.Builder
	b.WriteString("name: bench\nversion: 1\n")
	dir := ""
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
		if i < cfg.Steps {
			fmt.Fprintf(&b, "    next: [{to: s%d}]\n", i+1)
		}
	}
	return schemas.Parse("bench.yaml", []byte(b.String()), schemas.LoadOptions{BaseDir: dir,
		Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().Check(&steps.Env{ModelMode: steps.ModelReplay})}})
}
