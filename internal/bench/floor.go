package bench

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// runFloor is the bare loop: per step one KV compare-and-swap of the
// checkpoint (the payload), one publish of the step message (the payload,
// with a dedup id), a pull and ack by a worker, one result publish, and a
// consume and ack by the "engine" side. Written the plain way: every call
// waits for its acknowledgement, and jobs run in parallel on goroutines.
func runFloor(ctx context.Context, cfg Config, tg *target, rec *recorder) error {
	nc, js, err := tg.connect("floor")
	if err != nil {
		return err
	}
	defer nc.Close()
	cps, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "floor_checkpoints", History: 1, Replicas: tg.replicas})
	if err != nil {
		return err
	}
	for _, sc := range []jetstream.StreamConfig{
		{Name: "FLOOR_WORK", Subjects: []string{"floor.work"}, Retention: jetstream.WorkQueuePolicy, Duplicates: 2 * time.Minute, Replicas: tg.replicas},
		{Name: "FLOOR_INBOX", Subjects: []string{"floor.inbox.*"}, Retention: jetstream.WorkQueuePolicy, Duplicates: 2 * time.Minute, Replicas: tg.replicas},
	} {
		if _, err := js.CreateStream(ctx, sc); err != nil {
			return err
		}
	}
	// On a cluster a stream answers once its leader is elected: the first
	// publications would find none ("no response from stream").
	for _, name := range []string{"FLOOR_WORK", "FLOOR_INBOX", "KV_floor_checkpoints"} {
		if err := waitStreamLeader(ctx, js, name); err != nil {
			return err
		}
	}
	consumer := func(stream, name string) (jetstream.Consumer, error) {
		return js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
			Durable: name, AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 20000, AckWait: time.Minute,
		})
	}
	wc, err := consumer("FLOOR_WORK", "floor-work")
	if err != nil {
		return err
	}
	ic, err := consumer("FLOOR_INBOX", "floor-engine")
	if err != nil {
		return err
	}
	payload := bytes.Repeat([]byte("x"), cfg.Payload)
	var revs sync.Map // job → uint64
	slots := make(chan struct{}, cfg.Concurrency)
	errs := make(chan error, 1)
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	dispatch := func(job string, step int) error {
		m := nats.NewMsg("floor.work")
		m.Data = payload
		m.Header.Set("Job", job)
		m.Header.Set("Step", strconv.Itoa(step))
		m.Header.Set(jetstream.MsgIDHeader, job+"/"+strconv.Itoa(step))
		_, err := js.PublishMsg(ctx, m)
		return err
	}

	workerSem := make(chan struct{}, cfg.Workers)
	wcc, err := wc.Consume(func(m jetstream.Msg) {
		workerSem <- struct{}{}
		go func() {
			defer func() { <-workerSem }()
			job, step := m.Headers().Get("Job"), m.Headers().Get("Step")
			r := nats.NewMsg("floor.inbox." + job)
			r.Data = []byte(`{}`)
			r.Header.Set("Step", step)
			r.Header.Set(jetstream.MsgIDHeader, job+"/"+step+"/result")
			if _, err := js.PublishMsg(ctx, r); err != nil {
				fail(fmt.Errorf("floor worker: %w", err))
				return
			}
			_ = m.Ack()
		}()
	})
	if err != nil {
		return err
	}
	defer wcc.Stop()

	engineSem := make(chan struct{}, cfg.Concurrency)
	icc, err := ic.Consume(func(m jetstream.Msg) {
		engineSem <- struct{}{}
		go func() {
			defer func() { <-engineSem }()
			job := m.Subject()[len("floor.inbox."):]
			step, _ := strconv.Atoi(m.Headers().Get("Step"))
			rv, _ := revs.Load(job)
			rev, err := cps.Update(ctx, job, payload, rv.(uint64))
			if err != nil {
				fail(fmt.Errorf("floor checkpoint %s: %w", job, err))
				return
			}
			revs.Store(job, rev)
			final := step == cfg.Steps
			if !final {
				if err := dispatch(job, step+1); err != nil {
					fail(err)
					return
				}
			}
			_ = m.Ack()
			rec.stepDone(job, final)
			if final {
				<-slots
			}
		}()
	})
	if err != nil {
		return err
	}
	defer icc.Stop()

	fctx, stopFeed := context.WithCancel(ctx)
	defer stopFeed()
	go feed(fctx, cfg, slots, func(job string) error {
		rec.began(job)
		rev, err := cps.Create(ctx, job, payload)
		if err != nil {
			fail(err)
			return err
		}
		revs.Store(job, rev)
		if err := dispatch(job, 1); err != nil {
			fail(err)
			return err
		}
		return nil
	})
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case err := <-errs:
			_ = err
			cancel()
			errs <- err
		case <-wctx.Done():
		}
	}()
	if err := rec.wait(wctx); err != nil {
		select {
		case e := <-errs:
			return e
		default:
		}
		return err
	}
	return nil
}

// feed starts cfg.Jobs jobs named job0, job1, ..., at most cfg.Concurrency
// in flight (a slot is taken before a start and given back by whoever sees
// the job end). Starts run on up to 32 goroutines, as many clients would
// start them: one sequential starter would cap the jobs in flight at what
// its round trips allow. It returns when every job was started or a start
// failed.
func feed(ctx context.Context, cfg Config, slots chan struct{}, start func(job string) error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(cfg.Concurrency, 32) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(cfg.Jobs) {
					return
				}
				select {
				case slots <- struct{}{}:
				case <-ctx.Done():
					return
				}
				if start("job"+strconv.FormatInt(i, 10)) != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
}

// waitStreamLeader waits until stream name has a leader (at once on one
// server).
func waitStreamLeader(ctx context.Context, js jetstream.JetStream, name string) error {
	for {
		st, err := js.Stream(ctx, name)
		if err == nil {
			if info, err := st.Info(ctx); err == nil && (info.Cluster == nil || info.Cluster.Leader != "") {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("stream %s has no leader: %w", name, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
