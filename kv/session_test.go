package kv_test

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// TestSessionStoreRevisions: values by namespace and key, with revisions;
// a write expecting another revision (or no value) is a conflict and
// changes nothing; list and delete see one namespace only.
func TestSessionStoreRevisions(t *testing.T) {
	b := setup(t, kv.Config{})
	c, s := ctx(t), b.store.Session
	zero := uint64(0)
	r1, err := s.Put(c, "user-1", "prefs", json.RawMessage(`{"lang":"fr"}`), &zero)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(c, "user-1", "prefs", json.RawMessage(`{}`), &zero); !errors.Is(err, schemas.ErrConflict) {
		t.Fatalf("create over a value: %v", err)
	}
	stale := r1 + 100
	if _, err := s.Put(c, "user-1", "prefs", json.RawMessage(`{}`), &stale); !errors.Is(err, schemas.ErrConflict) {
		t.Fatalf("write over another revision: %v", err)
	}
	r2, err := s.Put(c, "user-1", "prefs", json.RawMessage(`{"lang":"de"}`), &r1)
	if err != nil || r2 <= r1 {
		t.Fatalf("write over its revision: %d %v", r2, err)
	}
	if _, err := s.Put(c, "user-2", "prefs", json.RawMessage(`1`), nil); err != nil {
		t.Fatal(err)
	}
	e, err := s.Get(c, "user-1", "prefs")
	if err != nil || string(e.Value) != `{"lang":"de"}` || e.Revision != r2 {
		t.Fatalf("get: %+v %v", e, err)
	}
	if es, err := s.List(c, "user-1"); err != nil || len(es) != 1 || es[0].Key != "prefs" {
		t.Fatalf("list: %+v %v", es, err)
	}
	if err := s.Delete(c, "user-1", "prefs", &r1); !errors.Is(err, schemas.ErrConflict) {
		t.Fatalf("delete at another revision: %v", err)
	}
	if err := s.Delete(c, "user-1", "prefs", &r2); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(c, "user-1", "prefs"); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("get after delete: %v", err)
	}
	if err := s.Delete(c, "user-1", "prefs", nil); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("delete of nothing: %v", err)
	}
	if _, err := s.Put(c, "user.1", "k", json.RawMessage(`1`), nil); !errors.Is(err, schemas.ErrInputInvalid) {
		t.Fatalf("a namespace with a dot: %v", err)
	}
}
