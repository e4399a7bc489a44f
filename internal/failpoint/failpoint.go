// Package failpoint injects faults at named points in the engine and the
// worker, for crash tests with real processes. Points are off unless a Set
// names them, usually parsed from WAYMARK_FAILPOINTS:
//
//	WAYMARK_FAILPOINTS="engine.after_checkpoint=crash@2,worker.after_receive=delay=3s"
//
// Actions: crash (the process kills itself with SIGKILL at once: no
// deferred calls, no flushing, as if killed from outside), crash@N (on the
// N-th time the point is reached, counting from 1), crash/STEP (the first
// time it is reached while handling step STEP), crash/STEP@N (the N-th
// such time: an agent step's turns and tool calls), delay=DURATION (stall
// there, or until the context ends). The idea follows FreeBSD's fail(9)
// and etcd's gofail: names in the code, actions from configuration.
//
// An agent step's tool calls are reached as "<step>.<tool>" by the
// worker's points: crash/STEP matches the step's model turns and every
// tool call, crash/STEP.TOOL the calls of one tool.
package failpoint

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// EnvVar is the environment variable Parse reads in the binaries.
const EnvVar = "WAYMARK_FAILPOINTS"

// Known points. Each sits at a step of the protocol where a crash is worth
// testing; see the README's crash matrix.
const (
	EngineAfterIntake         = "engine.after_intake"          // an inbox message was received, nothing done yet
	EngineBeforeCheckpoint    = "engine.before_checkpoint"     // a transition was decided, not yet written
	EngineAfterCheckpoint     = "engine.after_checkpoint"      // the checkpoint was written, its dispatch not yet published
	EngineAfterDispatch       = "engine.after_dispatch"        // dispatch and history published, the inbox message not yet acknowledged
	EngineAfterResultReceived = "engine.after_result_received" // a step result was received, not yet applied
	WorkerAfterReceive        = "worker.after_receive"         // a step message was received, the step not yet run
	WorkerAfterPrepared       = "worker.after_prepared"        // the effect record was written prepared, the call not yet made
	WorkerAfterRemoteCommit   = "worker.after_remote_commit"   // the external call returned, the ledger not yet confirmed
	WorkerAfterConfirm        = "worker.after_confirm"         // the ledger was confirmed, the result not yet published
	WorkerAfterResultPublish  = "worker.after_result_publish"  // the result was published, the step message not yet acknowledged
	// TriggerAfterStart: a CloudEvent's jobs were started (stored), its
	// dedup record not yet written (engine/trigger).
	TriggerAfterStart = "trigger.after_start"
)

// Known lists every point, for validation and for crash matrices.
var Known = []string{
	EngineAfterIntake, EngineBeforeCheckpoint, EngineAfterCheckpoint, EngineAfterDispatch, EngineAfterResultReceived,
	WorkerAfterReceive, WorkerAfterPrepared, WorkerAfterRemoteCommit, WorkerAfterConfirm, WorkerAfterResultPublish,
	TriggerAfterStart,
}

type action struct {
	crash bool
	at    int    // crash on this hit; 0 = first
	step  string // only while handling this step; "" = any
	delay time.Duration
	hits  int
}

// Set is a parsed failpoint configuration. The nil *Set has no points and
// costs one nil check per Inject. Safe for concurrent use.
type Set struct {
	mu     sync.Mutex
	points map[string]*action
	exit   func() // how crash ends the process; replaced in tests
}

// Parse reads a comma-separated list of name=action. An empty spec gives a
// nil Set. Unknown names and malformed actions are errors naming them.
func Parse(spec string) (*Set, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return nil, nil
	}
	s := &Set{points: map[string]*action{}, exit: killSelf}
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, act, ok := strings.Cut(item, "=")
		if !ok {
			return nil, fmt.Errorf("failpoint %q: want name=action (crash, crash@N, crash/STEP, crash/STEP@N, delay=DURATION)", item)
		}
		if !isKnown(name) {
			return nil, fmt.Errorf("failpoint %q: unknown point; known: %s", name, strings.Join(sorted(Known), ", "))
		}
		a, err := parseAction(act)
		if err != nil {
			return nil, fmt.Errorf("failpoint %s: %w", name, err)
		}
		s.points[name] = a
	}
	return s, nil
}

// FromEnv parses the WAYMARK_FAILPOINTS environment variable.
func FromEnv() (*Set, error) { return Parse(os.Getenv(EnvVar)) }

func parseAction(s string) (*action, error) {
	switch {
	case s == "crash":
		return &action{crash: true}, nil
	case strings.HasPrefix(s, "crash/"):
		step, at, counted := strings.Cut(strings.TrimPrefix(s, "crash/"), "@")
		if step == "" {
			return nil, fmt.Errorf("action %q: want crash/STEP or crash/STEP@N with a step id", s)
		}
		a := &action{crash: true, step: step}
		if counted {
			n, err := strconv.Atoi(at)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("action %q: want crash/STEP@N with N >= 1", s)
			}
			a.at = n
		}
		return a, nil
	case strings.HasPrefix(s, "crash@"):
		n, err := strconv.Atoi(strings.TrimPrefix(s, "crash@"))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("action %q: want crash@N with N >= 1", s)
		}
		return &action{crash: true, at: n}, nil
	case strings.HasPrefix(s, "delay="):
		d, err := time.ParseDuration(strings.TrimPrefix(s, "delay="))
		if err != nil || d < 0 {
			return nil, fmt.Errorf("action %q: want delay=DURATION such as delay=2s", s)
		}
		return &action{delay: d}, nil
	}
	return nil, fmt.Errorf("action %q: want crash, crash@N, crash/STEP, crash/STEP@N or delay=DURATION", s)
}

// Inject runs the action configured for point, if any. A crash does not
// return. A delay returns early when ctx ends.
func (s *Set) Inject(ctx context.Context, point string) { s.InjectStep(ctx, point, "") }

// InjectStep is Inject for a point reached while handling step (empty when
// no step applies): a crash/STEP action fires only for its step.
func (s *Set) InjectStep(ctx context.Context, point, step string) {
	if s == nil {
		return
	}
	s.mu.Lock()
	a, ok := s.points[point]
	if !ok || (a.step != "" && a.step != step && !strings.HasPrefix(step, a.step+".")) {
		s.mu.Unlock()
		return
	}
	a.hits++
	crash := a.crash && (a.at == 0 || a.hits == a.at)
	delay := a.delay
	s.mu.Unlock()
	if crash {
		fmt.Fprintf(os.Stderr, "failpoint %s: crashing (pid %d)\n", point, os.Getpid())
		s.exit()
		return
	}
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
	}
}

// Enabled reports whether point has an action.
func (s *Set) Enabled(point string) bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.points[point]
	return ok
}

func killSelf() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL is not deliverable to a blocked handler; wait for it
}

func isKnown(name string) bool {
	for _, k := range Known {
		if k == name {
			return true
		}
	}
	return false
}

func sorted(xs []string) []string {
	c := append([]string(nil), xs...)
	sort.Strings(c)
	return c
}
