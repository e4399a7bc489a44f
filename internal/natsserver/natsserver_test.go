package natsserver

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
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
