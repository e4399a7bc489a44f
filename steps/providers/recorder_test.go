package providers_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/steps/providers"
)

func TestRecorderRoundTrip(t *testing.T) {
	t.Parallel()
	srv := fakemodel.NewAnthropic(t, fakemodel.Queue(
		fakemodel.Response{Text: "positive <3 & more", InputTokens: 10, OutputTokens: 4},
		fakemodel.Response{Status: 500, Text: "boom"},
		fakemodel.Response{Text: "negative", InputTokens: 10, OutputTokens: 1},
		fakemodel.Response{Text: "a summary", InputTokens: 20, OutputTokens: 2},
	))
	live := providers.NewAnthropic(providers.Config{APIKey: testKey, BaseURL: srv.URL(), HTTPClient: srv.Client()})
	path := filepath.Join(t.TempDir(), "cassettes", "flow.json") // the directory does not exist yet
	rec := providers.NewRecorder(live, path)

	classify := providers.Request{Model: "model-a", System: "One word.", Prompt: "I love it", Step: "classify", Attempt: 1}
	summarise := providers.Request{Model: "model-b", Prompt: "Summarise: ...", Step: "summarise", Attempt: 1}
	calls := []struct {
		req     providers.Request
		wantErr bool
	}{
		{req: classify},
		{req: classify, wantErr: true}, // the 500 is returned and not recorded
		{req: classify},
		{req: summarise},
	}
	var recorded []providers.Reply
	for i, c := range calls {
		reply, err := rec.Complete(t.Context(), c.req)
		if c.wantErr {
			assertProviderError(t, err, providers.Anthropic, true)
			continue
		}
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		recorded = append(recorded, reply)
	}

	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read cassette: %v", err)
	}
	if bytes.Contains(data, []byte(testKey)) {
		t.Fatal("cassette contains the API key")
	}
	if !bytes.Contains(data, []byte("positive <3 & more")) {
		t.Errorf("cassette escapes text; want it readable:\n%s", data)
	}
	c, err := providers.ParseCassette(data)
	if err != nil {
		t.Fatalf("ParseCassette: %v\n%s", err, data)
	}
	if len(c.Interactions) != 2 {
		t.Fatalf("%d interactions, want 2 (same step and prompt merge):\n%s", len(c.Interactions), data)
	}
	first := c.Interactions[0]
	if first.Step != "classify" || first.PromptSHA256 != providers.PromptHash(classify) || first.Model != "model-a" || len(first.Replies) != 2 {
		t.Errorf("first interaction = %+v", first)
	}

	replay := providers.NewReplay(c)
	for i, tt := range []struct {
		req  providers.Request
		want providers.Reply
	}{
		{req: classify, want: recorded[0]},
		{req: withAttempt(classify, 2), want: recorded[1]},
		{req: summarise, want: recorded[2]},
	} {
		got, err := replay.Complete(t.Context(), tt.req)
		if err != nil {
			t.Fatalf("replay %d: %v", i, err)
		}
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("replay %d = %+v, want the recorded %+v", i, got, tt.want)
		}
	}
	if leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(path), ".*tmp*")); len(leftovers) != 0 {
		t.Errorf("temporary files left behind: %v", leftovers)
	}
}

func withAttempt(req providers.Request, n int) providers.Request {
	req.Attempt = n
	return req
}

func TestRecorderConcurrent(t *testing.T) {
	t.Parallel()
	live := providerFunc(func(_ context.Context, req providers.Request) (providers.Reply, error) {
		return providers.Reply{Text: "re: " + req.Prompt}, nil
	})
	path := filepath.Join(t.TempDir(), "c.json")
	// Two recorders on one file share its lock.
	recs := []providers.Provider{providers.NewRecorder(live, path), providers.NewRecorder(live, path)}

	const n = 16
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			req := providers.Request{Step: fmt.Sprintf("step-%d", i%4), Prompt: fmt.Sprintf("prompt %d", i)}
			if _, err := recs[i%2].Complete(t.Context(), req); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	c, err := providers.ParseCassette(data)
	if err != nil {
		t.Fatalf("ParseCassette: %v", err)
	}
	if len(c.Interactions) != n {
		t.Fatalf("%d interactions, want %d: a write was lost", len(c.Interactions), n)
	}
	replay := providers.NewReplay(c)
	for i := range n {
		req := providers.Request{Step: fmt.Sprintf("step-%d", i%4), Prompt: fmt.Sprintf("prompt %d", i)}
		got, err := replay.Complete(t.Context(), req)
		if err != nil || got.Text != "re: "+req.Prompt {
			t.Errorf("replay %d = %q, %v", i, got.Text, err)
		}
	}
}

func TestRecorderErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	corrupt := filepath.Join(dir, "corrupt.json")
	if err := os.WriteFile(corrupt, []byte(`{"version": 7}`), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		nilLive  bool
		path     string
		req      providers.Request
		wantErr  error
		wantMsg  string
		wantLive bool
	}{
		{name: "no step", path: filepath.Join(dir, "a.json"), req: providers.Request{Prompt: "p"}, wantMsg: "no step id"},
		{name: "nil live provider", nilLive: true, path: filepath.Join(dir, "b.json"), req: providers.Request{Step: "s", Prompt: "p"}, wantMsg: "no live provider"},
		{name: "empty path", path: "", req: providers.Request{Step: "s", Prompt: "p"}, wantMsg: "empty cassette path"},
		{name: "invalid existing cassette", path: corrupt, req: providers.Request{Step: "s", Prompt: "p"}, wantErr: providers.ErrInvalidCassette, wantMsg: "version 7", wantLive: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var called atomic.Bool
			var live providers.Provider = providerFunc(func(context.Context, providers.Request) (providers.Reply, error) {
				called.Store(true)
				return providers.Reply{Text: "x"}, nil
			})
			if tt.nilLive {
				live = nil
			}
			_, err := providers.NewRecorder(live, tt.path).Complete(t.Context(), tt.req)
			if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("error = %v, want errors.Is %v", err, tt.wantErr)
			}
			perr := assertProviderError(t, err, "recorder", false)
			if !strings.Contains(perr.Message, tt.wantMsg) {
				t.Errorf("Message = %q, want it to contain %q", perr.Message, tt.wantMsg)
			}
			if called.Load() != tt.wantLive {
				t.Errorf("live provider called = %v, want %v", called.Load(), tt.wantLive)
			}
			if tt.path == corrupt {
				if data, _ := os.ReadFile(corrupt); string(data) != `{"version": 7}` {
					t.Errorf("invalid cassette was overwritten: %s", data)
				}
			}
		})
	}
}
