package natsserver

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestDataDirIsLockedWhileAServerRuns(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	first, err := Start(Config{DataDir: dir, Sync: SyncInterval})
	if err != nil {
		t.Fatal(err)
	}
	_, err = Start(Config{DataDir: dir, Sync: SyncInterval})
	if !errors.Is(err, ErrDataDirInUse) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "pid") {
		t.Fatalf("second server on the same directory: %v, want ErrDataDirInUse naming the directory and the holder", err)
	}
	first.Stop(context.Background())
	again, err := Start(Config{DataDir: dir, Sync: SyncInterval})
	if err != nil {
		t.Fatalf("after the first stopped: %v", err)
	}
	again.Stop(context.Background())
}

func TestBadSettingsFailFast(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"port taken", Config{DataDir: t.TempDir(), Listen: ln.Addr().String()}, "cannot listen on"},
		{"negative sync interval", Config{DataDir: t.TempDir(), Sync: SyncInterval, SyncInterval: -1}, "positive duration"},
		{"unknown sync policy", Config{DataDir: t.TempDir(), Sync: "sometimes"}, `sync policy "sometimes"`},
		{"no data directory", Config{}, "no data directory"},
	} {
		if _, err := Start(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

func TestParseSize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in      string
		want    int64
		wantErr bool
	}{
		{"", 0, false},
		{"0", 0, false},
		{"4096", 4096, false},
		{"512MiB", 512 << 20, false},
		{"10GB", 10_000_000_000, false},
		{"1.5 GiB", 3 << 29, false},
		{"64kib", 64 << 10, false},
		{"lots", 0, true},
		{"-1GB", 0, true},
		{"12XB", 0, true},
	} {
		got, err := ParseSize(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d, error %v", tc.in, got, err, tc.want, tc.wantErr)
		}
		if err != nil && !strings.Contains(err.Error(), strconv.Quote(tc.in)) {
			t.Errorf("ParseSize(%q): error %q does not quote the value", tc.in, err)
		}
	}
}

// insufficientResources is the server's JSInsufficientResourcesErr code,
// which nats.go does not name.
const insufficientResources jetstream.ErrorCode = 10023

// TestMaxStoreRefusesWritesAndRecovers: with MaxStore, a write that would
// go beyond it is refused with insufficient resources, what was stored
// stays, and writes succeed again once space is freed.
func TestMaxStoreRefusesWritesAndRecovers(t *testing.T) {
	t.Parallel()
	if _, err := Start(Config{DataDir: t.TempDir(), MaxStore: -1}); err == nil || !strings.Contains(err.Error(), "max store -1") {
		t.Fatalf("negative MaxStore: %v, want an error naming it", err)
	}
	srv, err := Start(Config{DataDir: t.TempDir(), Sync: SyncInterval, MaxStore: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop(context.Background())
	nc, js, err := srv.JetStream("test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, name := range []string{"KEEP", "FILL"} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name)}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := js.Publish(ctx, "keep", []byte("precious")); err != nil {
		t.Fatal(err)
	}
	chunk := make([]byte, 32<<10)
	var refused error
	for i := 0; i < 64 && refused == nil; i++ { // 2 MiB at most: twice the limit
		_, refused = js.Publish(ctx, "fill", chunk)
	}
	var apiErr *jetstream.APIError
	if !errors.As(refused, &apiErr) || apiErr.ErrorCode != insufficientResources {
		t.Fatalf("filling past MaxStore: %v, want insufficient resources (10023)", refused)
	}
	if _, err := js.Publish(ctx, "keep", chunk); err == nil {
		t.Fatal("a write to another stream went through while the store is full")
	}
	keep, err := js.Stream(ctx, "KEEP")
	if err != nil {
		t.Fatal(err)
	}
	if m, err := keep.GetMsg(ctx, 1); err != nil || string(m.Data) != "precious" {
		t.Fatalf("what was stored before: %v, %v", m, err)
	}
	if err := js.DeleteStream(ctx, "FILL"); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "keep", chunk); err != nil {
		t.Fatalf("after freeing space: %v", err)
	}
}

// TestFailedStartReleasesTheDataDir: a start refused for a bad listen
// address leaves the data directory free for the next one (it stayed
// locked for the rest of the process).
func TestFailedStartReleasesTheDataDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, listen := range []string{"nonsense", "127.0.0.1:port"} {
		if _, err := Start(Config{DataDir: dir, Sync: SyncInterval, Listen: listen}); err == nil {
			t.Fatalf("--listen %q accepted", listen)
		}
	}
	s, err := Start(Config{DataDir: dir, Sync: SyncInterval})
	if err != nil {
		t.Fatalf("after failed starts: %v", err)
	}
	s.Stop(context.Background())
}
