package engine

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

func TestSetMembers(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, state, set, want string
		wantErr                bool
	}{
		{"append", `{"a":1}`, `{"b":{"c":[1,"}"]}}`, `{"a":1,"b":{"c":[1,"}"]}}`, false},
		{"replace in place", `{"a":1,"b":2,"c":3}`, `{"b":"x"}`, `{"a":1,"b":"x","c":3}`, false},
		{"empty state", `{}`, `{"a":true}`, `{"a":true}`, false},
		{"empty set", ` { "a" : [ 1 , 2 ] } `, `{}`, `{"a":[ 1 , 2 ]}`, false},
		{"escaped key matches", `{"\u0061":1}`, `{"a":2}`, `{"\u0061":2}`, false},
		{"strings with braces and quotes", `{"s":"{\"[\\"}`, `{"t":"]"}`, `{"s":"{\"[\\","t":"]"}`, false},
		{"duplicate keys in set: last wins", `{}`, `{"a":1,"a":2}`, `{"a":2}`, false},
		{"nested objects untouched", `{"a":{"b":{"c":null}},"d":-1.5e3}`, `{"e":false}`, `{"a":{"b":{"c":null}},"d":-1.5e3,"e":false}`, false},
		{"state not an object", `[1]`, `{"a":1}`, "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			set, err := members([]byte(tt.set))
			if err != nil {
				t.Fatal(err)
			}
			got, err := setMembers([]byte(tt.state), set)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("want an error, got %s", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tt.want {
				t.Fatalf("got  %s\nwant %s", got, tt.want)
			}
			if !json.Valid(got) {
				t.Fatalf("invalid JSON %s", got)
			}
		})
	}
}

// FuzzSetMembers checks the splice against decoding, merging as maps and
// comparing.
func FuzzSetMembers(f *testing.F) {
	f.Add(`{"a":1,"b":[1,{"c":"}"}]}`, `{"b":null,"d":"x"}`)
	f.Add(`{}`, `{"\"":"\\"}`)
	f.Add(` {"a" : { } } `, `{"a":[]}`)
	f.Fuzz(func(t *testing.T, state, set string) {
		var sm, xm map[string]any
		if json.Unmarshal([]byte(state), &sm) != nil || json.Unmarshal([]byte(set), &xm) != nil || sm == nil || xm == nil {
			t.Skip()
		}
		ms, err := members([]byte(set))
		if err != nil {
			t.Fatalf("members(%q): %v", set, err)
		}
		got, err := setMembers([]byte(state), ms)
		if err != nil {
			t.Fatalf("setMembers(%q, %q): %v", state, set, err)
		}
		var gm map[string]any
		if err := json.Unmarshal(got, &gm); err != nil {
			t.Fatalf("result %q is not JSON: %v", got, err)
		}
		for k, v := range xm {
			sm[k] = v
		}
		if !reflect.DeepEqual(gm, sm) && !strings.Contains(state, `\u`) {
			t.Fatalf("state %s set %s\ngot  %s", state, set, got)
		}
	})
}

func TestOutboxIsOneHistoryMessage(t *testing.T) {
	t.Parallel()
	now := time.Now().UTC()
	evs := []schemas.Event{
		{Type: schemas.EventStepCompleted, Time: now, Data: schemas.HistoryData{Job: "j", Seq: 3, Step: "a"}},
		{Type: schemas.EventStepDispatched, Time: now, Data: schemas.HistoryData{Job: "j", Seq: 3, Step: "b"}},
		{Type: schemas.EventStepCompleted, Time: now, Data: schemas.HistoryData{Job: "j", Seq: 4, Step: "b"}},
	}
	cp := &schemas.Checkpoint{JobID: "j", IndexRev: 7, Seq: 4, Flushed: 2, Events: evs}
	hm := outboxMessage(cp, evs)
	if hm.id != "j/i7/4" || hm.seq != 4 {
		t.Fatalf("message %s (seq %d), want j/i7/4", hm.id, hm.seq)
	}
	got, err := schemas.DecodeHistory(hm.body)
	if err != nil {
		t.Fatal(err)
	}
	want := schemas.CheckpointHistory("j", evs)
	if len(got) != 3 || got[0].ID != "j/3/0" || got[1].ID != "j/3/1" || got[2].ID != "j/4/0" {
		t.Fatalf("events %+v", got)
	}
	for i := range got {
		if got[i].ID != want[i].ID || got[i].Type != want[i].Type {
			t.Errorf("event %d: published %s %s, checkpoint view %s %s", i, got[i].ID, got[i].Type, want[i].ID, want[i].Type)
		}
	}
}
