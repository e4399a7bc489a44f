package schemas_test

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// dur converts a time.Duration for the definition types.
func dur(d time.Duration) schemas.Duration { return schemas.Duration(d) }

func TestRetryOf(t *testing.T) {
	t.Parallel()
	defaults := schemas.RetryPolicy{MaxAttempts: schemas.DefaultMaxAttempts, Backoff: &schemas.Backoff{
		Initial: dur(schemas.DefaultBackoffInitial), Max: dur(schemas.DefaultBackoffMax), Multiplier: schemas.DefaultBackoffMultiple,
	}}
	rows := []struct {
		name     string
		defaults *schemas.RetryPolicy
		step     *schemas.RetryPolicy
		want     schemas.RetryPolicy
	}{
		{name: "nothing set", want: defaults},
		{
			name:     "defaults block only",
			defaults: &schemas.RetryPolicy{MaxAttempts: 5, Backoff: &schemas.Backoff{Initial: dur(2 * time.Second)}},
			want:     schemas.RetryPolicy{MaxAttempts: 5, Backoff: &schemas.Backoff{Initial: dur(2 * time.Second), Max: dur(time.Minute), Multiplier: 2}},
		},
		{
			name: "step only",
			step: &schemas.RetryPolicy{Backoff: &schemas.Backoff{Max: dur(5 * time.Second), Multiplier: 1.5}},
			want: schemas.RetryPolicy{MaxAttempts: 3, Backoff: &schemas.Backoff{Initial: dur(time.Second), Max: dur(5 * time.Second), Multiplier: 1.5}},
		},
		{
			name:     "step overrides the defaults field by field",
			defaults: &schemas.RetryPolicy{MaxAttempts: 5, Backoff: &schemas.Backoff{Initial: dur(2 * time.Second), Max: dur(30 * time.Second), Multiplier: 3}},
			step:     &schemas.RetryPolicy{MaxAttempts: 9, Backoff: &schemas.Backoff{Max: dur(10 * time.Second)}},
			want:     schemas.RetryPolicy{MaxAttempts: 9, Backoff: &schemas.Backoff{Initial: dur(2 * time.Second), Max: dur(10 * time.Second), Multiplier: 3}},
		},
		{
			name:     "step without backoff keeps the defaults' backoff",
			defaults: &schemas.RetryPolicy{Backoff: &schemas.Backoff{Initial: dur(100 * time.Millisecond)}},
			step:     &schemas.RetryPolicy{MaxAttempts: 1},
			want:     schemas.RetryPolicy{MaxAttempts: 1, Backoff: &schemas.Backoff{Initial: dur(100 * time.Millisecond), Max: dur(time.Minute), Multiplier: 2}},
		},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			d := &schemas.Definition{Defaults: schemas.StepDefaults{Retry: r.defaults}, Steps: []schemas.Step{{ID: "a", Kind: "noop", Retry: r.step}}}
			var before []byte
			if r.defaults != nil {
				before, _ = json.Marshal(r.defaults)
			}
			got := d.RetryOf(&d.Steps[0])
			if !reflect.DeepEqual(got, r.want) {
				t.Errorf("RetryOf = %+v %+v, want %+v %+v", got, got.Backoff, r.want, r.want.Backoff)
			}
			if r.defaults != nil {
				if after, _ := json.Marshal(r.defaults); string(after) != string(before) {
					t.Errorf("RetryOf modified the defaults: %s → %s", before, after)
				}
				if got.Backoff == r.defaults.Backoff {
					t.Error("RetryOf returned the defaults' Backoff pointer")
				}
			}
		})
	}

	t.Run("from a file", func(t *testing.T) {
		t.Parallel()
		def := loadValid(t)
		if got := def.RetryOf(def.Step("review")); got.MaxAttempts != 4 || *got.Backoff != (schemas.Backoff{Initial: dur(250 * time.Millisecond), Max: dur(8 * time.Second), Multiplier: 3}) {
			t.Errorf("review: %+v %+v", got, got.Backoff)
		}
		if got := def.RetryOf(def.Step("pay")); got.MaxAttempts != 6 || got.Backoff.Initial != dur(250*time.Millisecond) {
			t.Errorf("pay: %+v %+v", got, got.Backoff)
		}
	})
}

func TestRetryPolicyDelay(t *testing.T) {
	t.Parallel()
	std := schemas.RetryPolicy{MaxAttempts: 10, Backoff: &schemas.Backoff{Initial: dur(time.Second), Max: dur(10 * time.Second), Multiplier: 2}}
	rows := []struct {
		name string
		p    schemas.RetryPolicy
		next int
		want time.Duration
	}{
		{"negative attempt", std, -1, 0},
		{"attempt 0", std, 0, 0},
		{"first attempt has no delay", std, 1, 0},
		{"first retry waits Initial", std, 2, time.Second},
		{"second retry", std, 3, 2 * time.Second},
		{"third retry", std, 4, 4 * time.Second},
		{"fourth retry", std, 5, 8 * time.Second},
		{"capped at Max", std, 6, 10 * time.Second},
		{"stays capped", std, 1000, 10 * time.Second},
		{"no backoff", schemas.RetryPolicy{MaxAttempts: 3}, 3, 0},
		{"Initial above Max", schemas.RetryPolicy{Backoff: &schemas.Backoff{Initial: dur(time.Minute), Max: dur(time.Second), Multiplier: 2}}, 2, time.Second},
		{"multiplier 1 is constant", schemas.RetryPolicy{Backoff: &schemas.Backoff{Initial: dur(300 * time.Millisecond), Max: dur(time.Minute), Multiplier: 1}}, 50, 300 * time.Millisecond},
		{"fractional multiplier", schemas.RetryPolicy{Backoff: &schemas.Backoff{Initial: dur(100 * time.Millisecond), Max: dur(time.Minute), Multiplier: 1.5}}, 4, 225 * time.Millisecond},
		{"huge multiplier does not overflow", schemas.RetryPolicy{Backoff: &schemas.Backoff{Initial: dur(time.Hour), Max: dur(24 * time.Hour), Multiplier: 100}}, 1000, 24 * time.Hour},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			if got := r.p.Delay(r.next); got != r.want {
				t.Errorf("Delay(%d) = %v, want %v", r.next, got, r.want)
			}
		})
	}
}

func TestStepSettings(t *testing.T) {
	t.Parallel()
	d := &schemas.Definition{
		Defaults: schemas.StepDefaults{Timeout: dur(time.Minute), Pool: "gpu"},
		Steps: []schemas.Step{
			{ID: "plain", Kind: "noop"},
			{ID: "own", Kind: "http", Timeout: dur(5 * time.Second), Pool: "net", Effect: schemas.EffectLookup},
		},
	}
	bare := &schemas.Definition{Steps: []schemas.Step{{ID: "x", Kind: "noop"}}}
	if got := d.TimeoutOf(&d.Steps[0]); got != time.Minute {
		t.Errorf("TimeoutOf(plain) = %v, want the defaults' 1m", got)
	}
	if got := d.TimeoutOf(&d.Steps[1]); got != 5*time.Second {
		t.Errorf("TimeoutOf(own) = %v, want 5s", got)
	}
	if got := bare.TimeoutOf(&bare.Steps[0]); got != schemas.DefaultTimeout {
		t.Errorf("TimeoutOf(bare) = %v, want %v", got, schemas.DefaultTimeout)
	}
	if got := d.PoolOf(&d.Steps[0]); got != "gpu" {
		t.Errorf("PoolOf(plain) = %q, want the defaults' gpu", got)
	}
	if got := d.PoolOf(&d.Steps[1]); got != "net" {
		t.Errorf("PoolOf(own) = %q, want net", got)
	}
	if got := bare.PoolOf(&bare.Steps[0]); got != schemas.DefaultPool {
		t.Errorf("PoolOf(bare) = %q, want %q", got, schemas.DefaultPool)
	}
}

func TestEffectOf(t *testing.T) {
	t.Parallel()
	rows := []struct {
		kind   string
		effect schemas.EffectClass
		want   schemas.EffectClass
	}{
		{schemas.KindModel, "", schemas.EffectPure},
		{schemas.KindNoop, "", schemas.EffectPure},
		{schemas.KindHTTP, "", schemas.EffectIdempotent},
		{"payments.charge", "", schemas.EffectUnsafe},
		{schemas.KindHTTP, schemas.EffectUnsafe, schemas.EffectUnsafe},
		{schemas.KindModel, schemas.EffectLookup, schemas.EffectLookup},
		{"custom", schemas.EffectIdempotent, schemas.EffectIdempotent},
	}
	d := &schemas.Definition{}
	for _, r := range rows {
		s := &schemas.Step{ID: "s", Kind: r.kind, Effect: r.effect}
		if got := d.EffectOf(s); got != r.want {
			t.Errorf("EffectOf(kind %q, effect %q) = %q, want %q", r.kind, r.effect, got, r.want)
		}
	}
}

func TestStartStepAndLookup(t *testing.T) {
	t.Parallel()
	byHand := &schemas.Definition{Steps: []schemas.Step{{ID: "one"}, {ID: "two"}}}
	if got := byHand.StartStep(); got != "one" {
		t.Errorf("StartStep without start = %q, want the first step", got)
	}
	byHand.Start = "two"
	if got := byHand.StartStep(); got != "two" {
		t.Errorf("StartStep = %q, want two", got)
	}
	decoded := loadValid(t)
	if got := decoded.StartStep(); got != "review" {
		t.Errorf("StartStep = %q, want review", got)
	}
	for _, d := range []*schemas.Definition{byHand, decoded} {
		for i, s := range d.Steps {
			if got := d.StepIndex(s.ID); got != i {
				t.Errorf("StepIndex(%q) = %d, want %d", s.ID, got, i)
			}
			if got := d.Step(s.ID); got != &d.Steps[i] {
				t.Errorf("Step(%q) does not point into Steps", s.ID)
			}
		}
		if d.StepIndex("absent") != -1 || d.Step("absent") != nil {
			t.Errorf("lookup of an absent step found something")
		}
	}
}

func TestDuration(t *testing.T) {
	t.Parallel()
	b, err := json.Marshal(dur(90 * time.Second))
	if err != nil || string(b) != `"1m30s"` {
		t.Errorf("Marshal = %s, %v; want \"1m30s\"", b, err)
	}
	rows := []struct {
		in      string
		want    time.Duration
		wantErr string
	}{
		{in: `"250ms"`, want: 250 * time.Millisecond},
		{in: `"1h2m3.5s"`, want: time.Hour + 2*time.Minute + 3500*time.Millisecond},
		{in: `1000000`, want: time.Millisecond},
		{in: `"5 minutes"`, wantErr: `duration "5 minutes"`},
		{in: `true`, wantErr: `want a string like "30s"`},
		{in: `1.5`, wantErr: `want a string like "30s"`},
	}
	for _, r := range rows {
		var d schemas.Duration
		err := json.Unmarshal([]byte(r.in), &d)
		switch {
		case r.wantErr != "":
			if err == nil || !strings.Contains(err.Error(), r.wantErr) {
				t.Errorf("Unmarshal(%s) error = %v, want %q", r.in, err, r.wantErr)
			}
		case err != nil || time.Duration(d) != r.want:
			t.Errorf("Unmarshal(%s) = %v, %v; want %v", r.in, time.Duration(d), err, r.want)
		}
	}
}

func TestMessageIDs(t *testing.T) {
	t.Parallel()
	for got, want := range map[string]string{
		schemas.StepMsgID("job-1", "fetch", 1):    "job-1/fetch/1",
		schemas.StepMsgID("job-1", "fetch", 0):    "job-1/fetch/0",
		schemas.StepMsgID("j", "s", 1234567):      "j/s/1234567",
		schemas.StepMsgID("j", "s", -12):          "j/s/-12",
		schemas.ResultMsgID("job-1", "fetch", 10): "job-1/fetch/10/result",
		schemas.StartMsgID("job-1"):               "job-1/start",
	} {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
	for s, terminal := range map[schemas.JobStatus]bool{
		schemas.JobRunning: false, schemas.JobQuarantined: false, schemas.JobCompleted: true, schemas.JobFailed: true,
	} {
		if s.Terminal() != terminal {
			t.Errorf("%s.Terminal() = %v", s, !terminal)
		}
	}
}
