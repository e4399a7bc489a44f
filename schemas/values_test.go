package schemas_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

// memValues is an in-memory value store for the pure helpers: put records
// what it was given, get answers from it.
type memValues struct {
	m    map[string][]byte
	puts int
	gets int
}

func newMemValues() *memValues { return &memValues{m: map[string][]byte{}} }

func (s *memValues) put(v []byte) (schemas.ValueRef, error) {
	s.puts++
	ref := schemas.NewValueRef(v)
	s.m[ref.Digest] = bytes.Clone(v)
	return ref, nil
}

func (s *memValues) get(r schemas.ValueRef) ([]byte, error) {
	s.gets++
	v, ok := s.m[r.Digest]
	if !ok {
		return nil, schemas.Errorf(schemas.CodeValueMissing, "value %s not stored", r.Digest)
	}
	return v, nil
}

func TestValueRefJSON(t *testing.T) {
	t.Parallel()
	ref := schemas.NewValueRef([]byte(`"hello"`))
	if !ref.Valid() || ref.Bytes != 7 || len(ref.Hex()) != 64 || !strings.HasPrefix(ref.Digest, "sha256:") {
		t.Fatalf("NewValueRef = %+v", ref)
	}
	want := `{"$waymark_value":"` + ref.Digest + `","bytes":7}`
	if got := string(ref.JSON()); got != want {
		t.Fatalf("JSON = %s, want %s", got, want)
	}
	back, ok := schemas.ParseValueRef(ref.JSON())
	if !ok || back != ref {
		t.Fatalf("ParseValueRef(JSON) = %+v, %v", back, ok)
	}
	if !ref.Matches([]byte(`"hello"`)) || ref.Matches([]byte(`"hellO"`)) {
		t.Error("Matches")
	}

	d := ref.Digest
	for _, tc := range []struct {
		name string
		raw  string
		want bool
	}{
		{"compact", `{"$waymark_value":"` + d + `","bytes":7}`, true},
		{"spaced, other order", " {\n \"bytes\" : 7 ,\t\"$waymark_value\" : \"" + d + "\" } ", true},
		{"zero bytes", `{"$waymark_value":"` + d + `","bytes":0}`, true},
		{"extra member", `{"$waymark_value":"` + d + `","bytes":7,"note":"mine"}`, false},
		{"user object with the name", `{"$waymark_value":"mine","other":1}`, false},
		{"only the name", `{"$waymark_value":"` + d + `"}`, false},
		{"duplicate name", `{"$waymark_value":"` + d + `","$waymark_value":"` + d + `"}`, false},
		{"upper-case hex", `{"$waymark_value":"` + strings.ToUpper(d) + `","bytes":7}`, false},
		{"short digest", `{"$waymark_value":"sha256:abcd","bytes":7}`, false},
		{"other algorithm", `{"$waymark_value":"sha512:` + ref.Hex() + `","bytes":7}`, false},
		{"escaped name", `{"\u0024waymark_value":"` + d + `","bytes":7}`, false},
		{"negative bytes", `{"$waymark_value":"` + d + `","bytes":-1}`, false},
		{"fractional bytes", `{"$waymark_value":"` + d + `","bytes":7.5}`, false},
		{"exponent bytes", `{"$waymark_value":"` + d + `","bytes":7e3}`, false},
		{"string bytes", `{"$waymark_value":"` + d + `","bytes":"7"}`, false},
		{"leading zero", `{"$waymark_value":"` + d + `","bytes":07}`, false},
		{"array", `[{"$waymark_value":"` + d + `","bytes":7}]`, false},
		{"trailing", `{"$waymark_value":"` + d + `","bytes":7} x`, false},
		{"string", `"$waymark_value"`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if _, ok := schemas.ParseValueRef(json.RawMessage(tc.raw)); ok != tc.want {
				t.Errorf("ParseValueRef(%s) = %v, want %v", tc.raw, ok, tc.want)
			}
		})
	}
}

func TestExternalizeResolveRoundTrip(t *testing.T) {
	t.Parallel()
	big := `{"text":"` + strings.Repeat("x", 300) + `","list":[1, 2, 3]}`
	bigCompact := `{"text":"` + strings.Repeat("x", 300) + `","list":[1,2,3]}`
	mid := `"` + strings.Repeat("y", 150) + `"`
	state := `{"z":1,"big":` + big + `,"small":"s","mid":` + mid + `,"a":[true,null]}`
	vs := newMemValues()

	out, err := schemas.ExternalizeMembers(json.RawMessage(state), 100, vs.put)
	if err != nil {
		t.Fatal(err)
	}
	bigRef, midRef := schemas.NewValueRef([]byte(bigCompact)), schemas.NewValueRef([]byte(mid))
	want := `{"z":1,"big":` + string(bigRef.JSON()) + `,"small":"s","mid":` + string(midRef.JSON()) + `,"a":[true,null]}`
	if string(out) != want {
		t.Fatalf("ExternalizeMembers =\n%s\nwant\n%s", out, want)
	}
	if vs.puts != 2 || string(vs.m[bigRef.Digest]) != bigCompact {
		t.Fatalf("puts %d, stored %q: want 2 puts, the big member compacted", vs.puts, vs.m[bigRef.Digest])
	}
	if !json.Valid(out) {
		t.Fatal("externalized state is not valid JSON")
	}
	if got := schemas.LogicalSize(out); got != len(out)-len(bigRef.JSON())-len(midRef.JSON())+len(bigCompact)+len(mid) {
		t.Errorf("LogicalSize = %d", got)
	}

	// Externalizing again stores nothing more: references stay as they are.
	again, err := schemas.ExternalizeMembers(out, 20, vs.put)
	if err != nil {
		t.Fatal(err)
	}
	if string(again) != want || vs.puts != 2 {
		t.Fatalf("second pass = %s after %d puts; want it unchanged", again, vs.puts)
	}

	back, err := schemas.ResolveRefs(out, vs.get)
	if err != nil {
		t.Fatal(err)
	}
	wantBack := `{"z":1,"big":` + bigCompact + `,"small":"s","mid":` + mid + `,"a":[true,null]}`
	if string(back) != wantBack {
		t.Fatalf("ResolveRefs =\n%s\nwant\n%s", back, wantBack)
	}
	if schemas.LogicalSize(out) != len(back) {
		t.Errorf("LogicalSize %d, resolved length %d", schemas.LogicalSize(out), len(back))
	}
	if got, _ := schemas.FindRefs(out); len(got) != 2 || got[0] != bigRef || got[1] != midRef {
		t.Errorf("FindRefs = %+v", got)
	}
}

func TestExternalizeMembers(t *testing.T) {
	t.Parallel()
	long := `"` + strings.Repeat("v", 64) + `"`
	for _, tc := range []struct {
		name      string
		state     string
		threshold int
		wantSame  bool // state itself comes back
		wantErr   error
		wantPuts  int
	}{
		{name: "nothing over", state: `{"a":1,"b":"two"}`, threshold: 16, wantSame: true},
		{name: "spaces do not count", state: `{"a": [1,   2,   3,   4]}`, threshold: 9, wantSame: true},
		{name: "exactly the threshold stays", state: `{"a":` + long + `}`, threshold: len(long), wantSame: true},
		{name: "one over goes", state: `{"a":` + long + `}`, threshold: len(long) - 1, wantPuts: 1},
		{name: "empty object", state: `{}`, threshold: 1, wantSame: true},
		{name: "small array state", state: `[1,2]`, threshold: 8, wantSame: true},
		{name: "large array state", state: `[` + long + `]`, threshold: 8, wantErr: schemas.ErrTooLarge},
		{name: "large string state", state: long, threshold: 8, wantErr: schemas.ErrTooLarge},
		{name: "nested reference", state: `{"a":{"pad":` + long + `,"r":` + string(schemas.NewValueRef([]byte(`1`)).JSON()) + `}}`, threshold: 8, wantErr: errAny},
		{name: "malformed", state: `{"a":` + long, threshold: 8, wantErr: errAny},
		{name: "trailing garbage", state: `{"a":1} {}`, threshold: 8, wantErr: errAny},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			vs := newMemValues()
			out, err := schemas.ExternalizeMembers(json.RawMessage(tc.state), tc.threshold, vs.put)
			if tc.wantErr != nil {
				if err == nil || (tc.wantErr != errAny && !errors.Is(err, tc.wantErr)) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.wantSame && string(out) != tc.state {
				t.Errorf("out = %s, want the state unchanged", out)
			}
			if vs.puts != tc.wantPuts {
				t.Errorf("puts = %d, want %d", vs.puts, tc.wantPuts)
			}
		})
	}

	t.Run("put error names the member", func(t *testing.T) {
		t.Parallel()
		boom := errors.New("store down")
		_, err := schemas.ExternalizeMembers(json.RawMessage(`{"report":`+long+`}`), 8,
			func([]byte) (schemas.ValueRef, error) { return schemas.ValueRef{}, boom })
		if !errors.Is(err, boom) || !strings.Contains(err.Error(), `"report"`) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("a put that returns another reference is refused", func(t *testing.T) {
		t.Parallel()
		_, err := schemas.ExternalizeMembers(json.RawMessage(`{"report":`+long+`}`), 8,
			func([]byte) (schemas.ValueRef, error) { return schemas.NewValueRef([]byte(`0`)), nil })
		if err == nil {
			t.Fatal("accepted a reference that does not match the value")
		}
	})
}

var errAny = errors.New("any error")

func TestResolveRefs(t *testing.T) {
	t.Parallel()
	vs := newMemValues()
	r1, _ := vs.put([]byte(`{"deep":[1,2,3]}`))
	r2, _ := vs.put([]byte(`"two"`))
	missing := schemas.NewValueRef([]byte(`"never stored"`))

	t.Run("nested at any depth", func(t *testing.T) {
		t.Parallel()
		doc := `{"a":{"b":[0,` + string(r1.JSON()) + `,{"c":` + string(r2.JSON()) + `}]},"d":` + string(r1.JSON()) + `}`
		got, err := schemas.ResolveRefs(json.RawMessage(doc), vs.get)
		if err != nil {
			t.Fatal(err)
		}
		want := `{"a":{"b":[0,{"deep":[1,2,3]},{"c":"two"}]},"d":{"deep":[1,2,3]}}`
		if string(got) != want {
			t.Fatalf("ResolveRefs = %s, want %s", got, want)
		}
		if refs, _ := schemas.FindRefs(json.RawMessage(doc)); len(refs) != 3 {
			t.Errorf("FindRefs found %d, want 3", len(refs))
		}
		if schemas.LogicalSize(json.RawMessage(doc)) != len(want) {
			t.Errorf("LogicalSize = %d, want %d", schemas.LogicalSize(json.RawMessage(doc)), len(want))
		}
	})
	t.Run("a fetched value is not searched again", func(t *testing.T) {
		t.Parallel()
		inner := []byte(`{"x":` + string(r2.JSON()) + `}`)
		raw := schemas.NewValueRef(inner)
		got, err := schemas.ResolveRefs(raw.JSON(), func(schemas.ValueRef) ([]byte, error) { return inner, nil })
		if err != nil || !bytes.Equal(got, inner) {
			t.Fatalf("ResolveRefs = %s, %v; want the value spliced as it is", got, err)
		}
	})
	t.Run("fast path", func(t *testing.T) {
		t.Parallel()
		doc := json.RawMessage(`{"a": [1, 2], "b": {"c": "$waymark"}}`)
		calls := 0
		got, err := schemas.ResolveRefs(doc, func(schemas.ValueRef) ([]byte, error) { calls++; return nil, nil })
		if err != nil || &got[0] != &doc[0] || calls != 0 {
			t.Fatalf("ResolveRefs = %s, %v, %d calls; want doc itself", got, err, calls)
		}
		if schemas.HasRefs(doc) || schemas.LogicalSize(doc) != len(doc) {
			t.Error("HasRefs or LogicalSize on a doc without references")
		}
		// The fast path does not decode: malformed bytes come back as they are.
		bad := json.RawMessage(`{"a":`)
		if got, err := schemas.ResolveRefs(bad, nil); err != nil || string(got) != string(bad) {
			t.Errorf("ResolveRefs(malformed, no marker) = %s, %v", got, err)
		}
	})
	t.Run("user object with the name is kept", func(t *testing.T) {
		t.Parallel()
		doc := json.RawMessage(`{"u":{"$waymark_value":"` + r2.Digest + `","bytes":5,"mine":true},"s":"\"$waymark_value\""}`)
		if !schemas.HasRefs(doc) {
			t.Fatal("HasRefs false on a doc with the marker")
		}
		got, err := schemas.ResolveRefs(doc, func(schemas.ValueRef) ([]byte, error) { return nil, errors.New("called") })
		if err != nil || string(got) != string(doc) {
			t.Fatalf("ResolveRefs = %s, %v; want doc unchanged", got, err)
		}
		if refs, err := schemas.FindRefs(doc); err != nil || len(refs) != 0 {
			t.Errorf("FindRefs = %v, %v", refs, err)
		}
		if schemas.LogicalSize(doc) != len(doc) {
			t.Errorf("LogicalSize = %d, want %d", schemas.LogicalSize(doc), len(doc))
		}
	})
	t.Run("one get per digest", func(t *testing.T) {
		t.Parallel()
		local := newMemValues()
		r, _ := local.put([]byte(`"v"`))
		doc := `[` + string(r.JSON()) + `,` + string(r.JSON()) + `,` + string(r.JSON()) + `]`
		got, err := schemas.ResolveRefs(json.RawMessage(doc), local.get)
		if err != nil || string(got) != `["v","v","v"]` || local.gets != 1 {
			t.Fatalf("ResolveRefs = %s, %v after %d gets", got, err, local.gets)
		}
	})
	t.Run("missing value", func(t *testing.T) {
		t.Parallel()
		_, err := schemas.ResolveRefs(json.RawMessage(`{"a":`+string(missing.JSON())+`}`), vs.get)
		if !errors.Is(err, schemas.ErrValueMissing) || !strings.Contains(err.Error(), missing.Digest) {
			t.Fatalf("err = %v, want ErrValueMissing naming %s", err, missing.Digest)
		}
	})
	t.Run("wrong length from get", func(t *testing.T) {
		t.Parallel()
		_, err := schemas.ResolveRefs(r2.JSON(), func(schemas.ValueRef) ([]byte, error) { return []byte(`"twoo"`), nil })
		if !errors.Is(err, schemas.ErrValueCorrupt) {
			t.Fatalf("err = %v, want ErrValueCorrupt", err)
		}
	})
	t.Run("malformed with the marker", func(t *testing.T) {
		t.Parallel()
		if _, err := schemas.ResolveRefs(json.RawMessage(`{"a":`+string(r2.JSON())), vs.get); err == nil {
			t.Fatal("accepted malformed JSON")
		}
	})
}

func TestValueErrorsRoundTrip(t *testing.T) {
	t.Parallel()
	for _, sentinel := range []error{schemas.ErrValueMissing, schemas.ErrValueCorrupt} {
		e := schemas.Errorf(sentinel.(*schemas.Error).Code, "value x")
		b, err := json.Marshal(e)
		if err != nil {
			t.Fatal(err)
		}
		var back schemas.Error
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		if !errors.Is(&back, sentinel) || !errors.Is(fmt.Errorf("wrapped: %w", e), sentinel) {
			t.Errorf("%s does not match %v after a round trip", b, sentinel)
		}
	}
}

// FuzzResolveRefs: whatever the document, resolving what was externalized
// gives the compact members back, and nothing panics.
func FuzzResolveRefs(f *testing.F) {
	f.Add(`{"a":"` + strings.Repeat("x", 40) + `","b":[1,{"c":2}]}`)
	f.Add(`{"$waymark_value":"sha256:` + strings.Repeat("0", 64) + `","bytes":3}`)
	f.Add(`[1,"$waymark_value",{}]`)
	f.Fuzz(func(t *testing.T, doc string) {
		vs := newMemValues()
		_, _ = schemas.FindRefs(json.RawMessage(doc))
		_ = schemas.LogicalSize(json.RawMessage(doc))
		_, _ = schemas.ResolveRefs(json.RawMessage(doc), vs.get)
		if !json.Valid([]byte(doc)) || schemas.HasRefs(json.RawMessage(doc)) {
			return
		}
		out, err := schemas.ExternalizeMembers(json.RawMessage(doc), 16, vs.put)
		if err != nil {
			return
		}
		if !json.Valid(out) {
			t.Fatalf("externalized %s into invalid JSON %s", doc, out)
		}
		back, err := schemas.ResolveRefs(out, vs.get)
		if err != nil {
			t.Fatal(err)
		}
		var want, got bytes.Buffer
		_ = json.Compact(&want, []byte(doc))
		_ = json.Compact(&got, back)
		if want.String() != got.String() {
			t.Fatalf("round trip of %s gave %s", doc, back)
		}
	})
}
