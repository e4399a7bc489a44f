package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/engine/api"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// paddedInput returns {"n":1,"p0":"xxx…","p1":…} of exactly size bytes,
// in members of at most 1,000 bytes: none is over a value threshold, so
// the input stays in the checkpoint and meets its limits.
func paddedInput(size int) json.RawMessage {
	b := []byte(`{"n":1`)
	for i := 0; len(b)+1 < size; i++ {
		frame := fmt.Sprintf(`,"p%d":""`, i)
		n := min(1000-len(frame), size-1-len(b)-len(frame))
		if n < 0 {
			// Too little room for another member: pad the last one.
			b = append(b[:len(b)-1], strings.Repeat("x", size-1-len(b)+1)...)
			b = append(b, '"')
			break
		}
		b = append(b, frame[:len(frame)-1]...)
		b = append(b, strings.Repeat("x", n)...)
		b = append(b, '"')
	}
	return json.RawMessage(append(b, '}'))
}

var fitsRE = regexp.MustCompile(`up to about (\d+) bytes fits`)

// TestStartRefusesInputsThatCannotFit starts a 900 KB input, which used to
// pass Start and fail at once when the engine wrote its first checkpoint
// (the input twice: as the state and in the job.started event): now Start
// refuses it naming the sizes, and stores nothing. An input of the size
// the refusal says fits runs to completion through the real engine, and
// one a little larger is refused.
func TestStartRefusesInputsThatCannotFit(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	def := b.define(threeSteps)
	ctx := context.Background()

	_, err := b.client.Start(ctx, def, paddedInput(900_000), client.StartOptions{JobID: "big"})
	if !errors.Is(err, schemas.ErrTooLarge) {
		t.Fatalf("900 KB input: got %v, want ErrTooLarge", err)
	}
	for _, want := range []string{"input is 900000 bytes", "first checkpoint", "over the limit of 1048576", "max_value_bytes"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if _, err := b.store.Checkpoints.Get(ctx, "big"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("a refused start left a checkpoint: %v", err)
	}
	m := fitsRE.FindStringSubmatch(err.Error())
	if m == nil {
		t.Fatalf("error %q does not say what fits", err)
	}
	fits, _ := strconv.Atoi(m[1])
	if fits < 500_000 || fits > 524_288 {
		t.Errorf("largest input that fits: %d bytes, want about half of 1 MiB", fits)
	}
	t.Logf("largest input that fits under the default limits: %d bytes", fits)

	id := b.start(def, string(paddedInput(fits)), "fits")
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("job with a %d-byte input: %s (%v), want completed", fits, v.Status, v.Error)
	}
	if _, err := b.client.Start(ctx, def, paddedInput(fits+2048), client.StartOptions{JobID: "over"}); !errors.Is(err, schemas.ErrTooLarge) {
		t.Errorf("input of %d bytes: got %v, want ErrTooLarge", fits+2048, err)
	}
}

// TestHTMLTextCostsItsSize: '<', '>' and '&' are stored and sent as one
// byte each (no \u003c escapes), so a 400 KB input of HTML starts and
// runs, and a step output of HTML is stored at its size.
func TestHTMLTextCostsItsSize(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	html := strings.Repeat("<p>&</p>", 50_000) // 400,000 bytes; 1.65 MB escaped
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		out, _ := schemas.Marshal(map[string]string{"html": html[:1000]})
		return out, nil
	})
	def := b.define(threeSteps)
	input, _ := schemas.Marshal(map[string]any{"n": 1, "page": html})
	id := b.start(def, string(input), "html")
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("job with %d bytes of HTML: %s (%v), want completed", len(input), v.Status, v.Error)
	}
	if strings.Contains(string(v.State), `\u003c`) || !strings.Contains(string(v.State), "<p>&</p>") {
		t.Errorf("state holds escaped HTML: %.200s", v.State)
	}
}

// TestStartSizeFollowsTheLayout checks each bound CheckStartSize names
// against a layout with a small checkpoint limit and one with a small
// message limit.
func TestStartSizeFollowsTheLayout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		cfg   kv.Config
		input int
		want  string
	}{
		{"checkpoint", kv.Config{MaxValueBytes: 64 << 10, MaxMessageBytes: 1 << 20}, 40 << 10, "first checkpoint"},
		{"step message", kv.Config{MaxValueBytes: 1 << 20, MaxMessageBytes: 64 << 10}, 60 << 10, "first step message"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, setupOptions{noEngine: true, kv: tc.cfg})
			def := b.define(threeSteps)
			_, err := b.client.Start(context.Background(), def, paddedInput(tc.input), client.StartOptions{JobID: "j"})
			if !errors.Is(err, schemas.ErrTooLarge) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrTooLarge about the %s", err, tc.want)
			}
			m := fitsRE.FindStringSubmatch(err.Error())
			if m == nil {
				t.Fatalf("error %q does not say what fits", err)
			}
			fits, _ := strconv.Atoi(m[1])
			if _, err := b.client.Start(context.Background(), def, paddedInput(fits), client.StartOptions{JobID: "fits"}); err != nil {
				t.Errorf("input of %d bytes, which the error says fits: %v", fits, err)
			}
		})
	}
}

// TestStartRefusesTextThatIsNotUnicode starts inputs and vars holding a
// lone surrogate or bytes that are not UTF-8: refused with the path,
// nothing stored.
func TestStartRefusesTextThatIsNotUnicode(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	def := b.define("name: v\nversion: 1\nvars: {greeting: hi}\nsteps:\n  - id: a\n    kind: noop\n")
	for i, tc := range []struct {
		input string
		vars  map[string]string
		path  string
	}{
		{input: `{"name": "x\ud800"}`, path: "/input/name"},
		{input: "{\"items\": [\"ok\", \"\xff\"]}", path: "/input/items/1"},
		{input: `{"n": 1}`, vars: map[string]string{"greeting": "h\xe9"}, path: "/vars/greeting"},
	} {
		id := fmt.Sprintf("text-%d", i)
		_, err := b.client.Start(context.Background(), def, json.RawMessage(tc.input), client.StartOptions{JobID: id, Vars: tc.vars})
		var te *schemas.TextError
		if !errors.Is(err, schemas.ErrInputInvalid) || !errors.As(err, &te) || te.Path != tc.path {
			t.Errorf("%s %v: got %v, want ErrInputInvalid at %s", tc.input, tc.vars, err, tc.path)
		}
		if _, err := b.store.Checkpoints.Get(context.Background(), id); !errors.Is(err, schemas.ErrNotFound) {
			t.Errorf("%s: a refused start left a checkpoint: %v", tc.input, err)
		}
	}
}

// TestHTTPAPIRefusesBadTextAndLargeBodies drives the HTTP API: a lone
// surrogate or invalid UTF-8 anywhere in a start or a resolution is 400
// naming its path; an input too large to start, or a body over
// api.MaxRequestBytes, is 413 too_large (it was 409 conflict).
func TestHTTPAPIRefusesBadTextAndLargeBodies(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	srv := httptest.NewServer((&api.API{Client: b.client, Checks: []schemas.CheckFunc{Check}}).Handler())
	t.Cleanup(srv.Close)
	def := b.define("name: three\nversion: 1\nvars: {greeting: hi}\nsteps:\n  - id: a\n    kind: noop\n")
	if err := b.store.Definitions.Put(context.Background(), def); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path, body string
		want             int
		code             string
		msg              []string
	}{
		{"lone surrogate in the input", "/v1/jobs", `{"workflow": "three", "input": {"a": ["x", "\ud800"]}}`, 400, "input_invalid",
			[]string{"at /input/a/1:", `\ud800 is one half of a UTF-16 surrogate pair`}},
		{"invalid UTF-8 in the input", "/v1/jobs", "{\"workflow\": \"three\", \"input\": {\"a\": \"\xc3(\"}}", 400, "input_invalid",
			[]string{"at /input/a:", "invalid UTF-8 byte 0xc3"}},
		{"lone surrogate in a var", "/v1/jobs", `{"workflow": "three", "input": {}, "vars": {"greeting": "\udc00"}}`, 400, "input_invalid",
			[]string{"at /vars/greeting:"}},
		{"lone surrogate in a resolution", "/v1/effects/resolve", `{"key": "j/a", "happened": true, "by": "a", "result": {"id": "\ud83d"}}`, 400, "input_invalid",
			[]string{"at /result/id:"}},
		{"invalid UTF-8 in a note", "/v1/effects/resolve", "{\"key\": \"j/a\", \"happened\": false, \"by\": \"a\", \"note\": \"\xff\"}", 400, "input_invalid",
			[]string{"at /note:"}},
		{"lone surrogate in a workflow", "/v1/workflows", "name: w\nversion: 1\ndescription: \"\\ud800\"\nsteps:\n  - id: a\n    kind: noop\n", 400, "definition_invalid",
			nil},
		{"input too large to start", "/v1/jobs", `{"workflow": "three", "input": ` + string(paddedInput(900_000)) + `}`, 413, "too_large",
			[]string{"input is 900000 bytes", "1048576"}},
		{"body over the limit", "/v1/jobs", `{"workflow": "three", "input": {"pad": "` + strings.Repeat("x", api.MaxRequestBytes) + `"}}`, 413, "too_large",
			[]string{"request body is over the limit of 8388608 bytes"}},
		{"workflow body over the limit", "/v1/workflows", "description: " + strings.Repeat("x", api.MaxRequestBytes), 413, "too_large", nil},
	} {
		resp, err := srv.Client().Post(srv.URL+tc.path, "application/json", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		var m struct {
			Error struct {
				Code     string           `json:"code"`
				Message  string           `json:"message"`
				Problems []map[string]any `json:"problems"`
			} `json:"error"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&m)
		resp.Body.Close()
		if resp.StatusCode != tc.want || m.Error.Code != tc.code {
			t.Errorf("%s: %d %s %q, want %d %s", tc.name, resp.StatusCode, m.Error.Code, m.Error.Message, tc.want, tc.code)
		}
		for _, w := range tc.msg {
			if !strings.Contains(m.Error.Message, w) {
				t.Errorf("%s: message %q lacks %q", tc.name, m.Error.Message, w)
			}
		}
		if tc.code == "definition_invalid" && (len(m.Error.Problems) != 1 || m.Error.Problems[0]["path"] != "/description" || m.Error.Problems[0]["line"] != float64(3)) {
			t.Errorf("%s: problems %v, want one at /description, line 3", tc.name, m.Error.Problems)
		}
		if strings.HasPrefix(tc.path, "/v1/jobs") && resp.StatusCode >= 400 {
			if _, err := b.store.Checkpoints.Get(context.Background(), "x"); !errors.Is(err, schemas.ErrNotFound) {
				t.Errorf("%s: something was stored", tc.name)
			}
		}
	}
}
