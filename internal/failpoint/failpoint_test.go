package failpoint

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		spec    string
		wantErr string
		points  []string
	}{
		{name: "empty", spec: ""},
		{name: "crash", spec: "engine.after_checkpoint=crash", points: []string{EngineAfterCheckpoint}},
		{name: "two", spec: "engine.after_checkpoint=crash@2, worker.after_receive=delay=1s", points: []string{EngineAfterCheckpoint, WorkerAfterReceive}},
		{name: "unknown point", spec: "engine.nowhere=crash", wantErr: "unknown point"},
		{name: "bad action", spec: "engine.after_intake=explode", wantErr: "want crash"},
		{name: "bad count", spec: "engine.after_intake=crash@0", wantErr: "N >= 1"},
		{name: "bad delay", spec: "engine.after_intake=delay=soon", wantErr: "delay=DURATION"},
		{name: "no action", spec: "engine.after_intake", wantErr: "name=action"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s, err := Parse(tt.spec)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Parse(%q) error = %v, want containing %q", tt.spec, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse(%q): %v", tt.spec, err)
			}
			for _, p := range tt.points {
				if !s.Enabled(p) {
					t.Errorf("point %s not enabled", p)
				}
			}
		})
	}
}

func TestCrashOnNthHit(t *testing.T) {
	t.Parallel()
	s, err := Parse("engine.after_dispatch=crash@3")
	if err != nil {
		t.Fatal(err)
	}
	crashes := 0
	s.exit = func() { crashes++ }
	for i := 1; i <= 5; i++ {
		s.Inject(context.Background(), EngineAfterDispatch)
		want := 0
		if i >= 3 {
			want = 1
		}
		if crashes != want {
			t.Fatalf("after hit %d: crashes = %d, want %d", i, crashes, want)
		}
	}
}

func TestCrashForOneStep(t *testing.T) {
	t.Parallel()
	s, err := Parse("worker.after_remote_commit=crash/notify")
	if err != nil {
		t.Fatal(err)
	}
	crashes := 0
	s.exit = func() { crashes++ }
	s.InjectStep(context.Background(), WorkerAfterRemoteCommit, "charge")
	s.Inject(context.Background(), WorkerAfterRemoteCommit)
	if crashes != 0 {
		t.Fatalf("crashed for another step")
	}
	s.InjectStep(context.Background(), WorkerAfterRemoteCommit, "notify")
	if crashes != 1 {
		t.Fatalf("crashes = %d, want 1", crashes)
	}
	if _, err := Parse("worker.after_receive=crash/"); err == nil {
		t.Fatal("crash/ without a step accepted")
	}
}

func TestDelayEndsWithContext(t *testing.T) {
	t.Parallel()
	s, err := Parse("worker.after_receive=delay=1h")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan struct{})
	go func() { s.Inject(ctx, WorkerAfterReceive); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("delay did not end with its context")
	}
}

func TestNilSetIsInert(t *testing.T) {
	t.Parallel()
	var s *Set
	s.Inject(context.Background(), EngineAfterIntake)
	if s.Enabled(EngineAfterIntake) {
		t.Fatal("nil set reports a point enabled")
	}
}

func TestCrashOnNthHitOfOneStep(t *testing.T) {
	t.Parallel()
	s, err := Parse("worker.after_receive=crash/agent@2")
	if err != nil {
		t.Fatal(err)
	}
	crashes := 0
	s.exit = func() { crashes++ }
	s.InjectStep(context.Background(), WorkerAfterReceive, "other")
	s.InjectStep(context.Background(), WorkerAfterReceive, "agent")
	if crashes != 0 {
		t.Fatalf("crashed at the first hit of the step, or for another step")
	}
	s.InjectStep(context.Background(), WorkerAfterReceive, "agent")
	if crashes != 1 {
		t.Fatalf("crashes = %d at the second hit of the step, want 1", crashes)
	}
	if _, err := Parse("worker.after_receive=crash/agent@0"); err == nil {
		t.Fatal("crash/agent@0 parsed")
	}
}

func TestCrashForOneToolOfAnAgent(t *testing.T) {
	t.Parallel()
	s, err := Parse("worker.after_remote_commit=crash/agent.mail,worker.after_receive=crash/agent")
	if err != nil {
		t.Fatal(err)
	}
	crashes := 0
	s.exit = func() { crashes++ }
	s.InjectStep(context.Background(), WorkerAfterRemoteCommit, "agent.pay")
	s.InjectStep(context.Background(), WorkerAfterRemoteCommit, "agent")
	s.InjectStep(context.Background(), WorkerAfterRemoteCommit, "agentx.mail")
	if crashes != 0 {
		t.Fatalf("crash/agent.mail fired for another tool, the turn, or another step")
	}
	s.InjectStep(context.Background(), WorkerAfterReceive, "agent.pay")
	s.InjectStep(context.Background(), WorkerAfterRemoteCommit, "agent.mail")
	if crashes != 2 {
		t.Fatalf("crashes = %d, want crash/agent for a tool call and crash/agent.mail for its tool", crashes)
	}
}
