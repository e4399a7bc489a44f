package schemas

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"
)

// The engine writes a checkpoint and a step message on every step, so they
// are encoded by hand: appended to a buffer in one pass, with the state
// (already compact JSON) copied as is, where encoding/json would validate
// and compact every json.RawMessage again. The output is what json.Marshal
// gives for the same value, field for field (tested both ways), and
// json.Unmarshal reads it.

// AppendJSON appends cp's JSON encoding to dst. cp.State must be valid
// JSON (the engine only stores state it produced or validated).
func (cp *Checkpoint) AppendJSON(dst []byte) []byte {
	w := jsonw{b: dst}
	w.open()
	w.intField("schema", int64(cp.Schema))
	w.strField("id", cp.JobID)
	w.strField("workflow", cp.Workflow)
	w.intField("version", int64(cp.Version))
	w.strField("definition_hash", cp.DefinitionHash)
	w.uintField("seq", cp.Seq)
	if cp.IndexRev != 0 {
		w.uintField("index_rev", cp.IndexRev)
	}
	if cp.ActiveRev != 0 {
		w.uintField("active_rev", cp.ActiveRev)
	}
	if cp.Reused {
		w.boolField("reused", true)
	}
	w.strField("status", string(cp.Status))
	if cp.InputDigest != "" {
		w.strField("input_digest", cp.InputDigest)
	}
	w.rawField("state", cp.State)
	if len(cp.Vars) > 0 {
		w.key("vars")
		w.strMap(cp.Vars)
	}
	if len(cp.Steps) > 0 {
		w.key("steps")
		w.b = append(w.b, '{')
		for i, id := range sortedKeys(cp.Steps) {
			if i > 0 {
				w.b = append(w.b, ',')
			}
			w.str(id)
			w.b = append(w.b, ':')
			w.stepRecord(cp.Steps[id])
		}
		w.b = append(w.b, '}')
	}
	if cp.Completed != "" {
		w.strField("completed", string(cp.Completed))
	}
	if cp.Current != nil {
		w.key("current")
		w.dispatch(cp.Current)
	}
	if cp.Fan != nil {
		// Rare and nested: encoding/json's form, which is the same.
		b, _ := json.Marshal(cp.Fan)
		w.rawField("fan", b)
	}
	if cp.Blocked != nil {
		w.key("blocked")
		w.open()
		w.strField("step", cp.Blocked.Step)
		w.strField("effect_key", cp.Blocked.EffectKey)
		if cp.Blocked.Class != "" {
			w.strField("class", string(cp.Blocked.Class))
		}
		if cp.Blocked.Reason != "" {
			w.strField("reason", cp.Blocked.Reason)
		}
		if cp.Blocked.LastError != nil {
			w.key("last_error")
			w.error(cp.Blocked.LastError)
		}
		if cp.Blocked.Item != 0 {
			w.intField("item", int64(cp.Blocked.Item))
		}
		if cp.Blocked.Attempt != 0 {
			w.intField("attempt", int64(cp.Blocked.Attempt))
		}
		w.close()
	}
	if cp.BlockedReason != "" {
		w.strField("blocked_reason", cp.BlockedReason)
	}
	if cp.BlockedFrom != "" {
		w.strField("blocked_from", string(cp.BlockedFrom))
	}
	if len(cp.EffectKeys) > 0 {
		w.key("effect_keys")
		w.b = append(w.b, '[')
		for i, k := range cp.EffectKeys {
			if i > 0 {
				w.b = append(w.b, ',')
			}
			w.str(k)
		}
		w.b = append(w.b, ']')
	}
	if len(cp.Transcripts) > 0 {
		b, _ := json.Marshal(cp.Transcripts)
		w.rawField("transcripts", b)
	}
	if len(cp.Approvals) > 0 {
		b, _ := Marshal(cp.Approvals)
		w.rawField("approvals", b)
	}
	if cp.Paused != nil {
		b, _ := Marshal(cp.Paused)
		w.rawField("paused", b)
	}
	if cp.Retries != 0 {
		w.intField("retries", int64(cp.Retries))
	}
	if len(cp.Signals) > 0 {
		b, _ := Marshal(cp.Signals)
		w.rawField("signals", b)
	}
	if cp.LastControl != nil {
		b, _ := Marshal(cp.LastControl)
		w.rawField("last_control", b)
	}
	if cp.LastSignal != nil {
		b, _ := Marshal(cp.LastSignal)
		w.rawField("last_signal", b)
	}
	if len(cp.ValidUntil) > 0 {
		b, _ := Marshal(cp.ValidUntil)
		w.rawField("valid_until", b)
	}
	if cp.Refresh != nil {
		b, _ := Marshal(cp.Refresh)
		w.rawField("refresh", b)
	}
	if cp.DeadlineAt != nil {
		w.timeField("deadline_at", *cp.DeadlineAt)
	}
	if cp.Cause != "" {
		w.strField("cause", cp.Cause)
	}
	if cp.Flushed != 0 {
		w.uintField("flushed", cp.Flushed)
	}
	if cp.Flush {
		w.boolField("flush", true)
	}
	if len(cp.Events) > 0 {
		w.key("events")
		w.b = append(w.b, '[')
		for i := range cp.Events {
			if i > 0 {
				w.b = append(w.b, ',')
			}
			w.event(&cp.Events[i])
		}
		w.b = append(w.b, ']')
	}
	w.intField("resume_count", int64(cp.ResumeCount))
	if cp.ResumedBy != "" {
		w.strField("resumed_by", cp.ResumedBy)
	}
	if cp.Writer != "" {
		w.strField("writer", cp.Writer)
	}
	if cp.Error != nil {
		w.key("error")
		w.error(cp.Error)
	}
	if cp.Parent != "" {
		w.strField("parent", cp.Parent)
	}
	if cp.Fork != nil {
		b, _ := Marshal(cp.Fork)
		w.rawField("fork", b)
	}
	if cp.Caller != nil {
		b, _ := json.Marshal(cp.Caller)
		w.rawField("caller", b)
	}
	w.timeField("created_at", cp.CreatedAt)
	w.timeField("updated_at", cp.UpdatedAt)
	if cp.CompletedAt != nil {
		w.timeField("completed_at", *cp.CompletedAt)
	}
	w.close()
	return w.b
}

// AppendJSON appends m's JSON encoding to dst. m.State must be valid JSON.
func (m *StepMessage) AppendJSON(dst []byte) []byte {
	w := jsonw{b: dst}
	w.open()
	w.strField("job", m.Job)
	w.strField("step", m.Step)
	w.intField("attempt", int64(m.Attempt))
	w.intField("run_attempt", int64(m.RunAttempt))
	w.strField("definition_hash", m.DefinitionHash)
	w.rawField("state", m.State)
	if len(m.Vars) > 0 {
		w.key("vars")
		w.strMap(m.Vars)
	}
	if m.NotBefore != nil {
		w.timeField("not_before", *m.NotBefore)
	}
	w.strField("idempotency_key", m.IdempotencyKey)
	if m.EffectKey != "" {
		w.strField("effect_key", m.EffectKey)
	}
	w.close()
	return w.b
}

// HistoryEvent is one CloudEvent of a job's history, as the history stream
// holds it (CloudEvents 1.0, JSON event format) and as clients read it. Its
// fields are in the order sdk-go's event.Event marshals them.
type HistoryEvent struct {
	SpecVersion     string      `json:"specversion"`
	ID              string      `json:"id"` // <job>/<seq>/<n>
	Source          string      `json:"source"`
	Type            string      `json:"type"`
	Subject         string      `json:"subject"` // the job id
	DataContentType string      `json:"datacontenttype"`
	Time            time.Time   `json:"time"` // UTC
	Data            HistoryData `json:"data"`
}

// AppendHistoryBatch appends a CloudEvents JSON batch (a JSON array of
// events; CloudEvents 1.0 JSON format, section 4) of job's events, the
// outbox of checkpoint sequence seq, to dst. Event ids are
// "<job>/<seq>/<n>": the sequence of the transition that wrote the event
// (Data.Seq; seq when unset) and its index among that transition's
// events, from 0.
func AppendHistoryBatch(dst []byte, source, job string, seq uint64, evs []Event) []byte {
	w := jsonw{b: append(dst, '[')}
	// Each event's id names the transition that made it (its own Seq, a
	// batch holding several) and its place among that transition's
	// events, as CheckpointHistory numbers the outbox: the same event
	// read from either has the same id.
	evSeq, n := uint64(0), 0
	for i := range evs {
		if i > 0 {
			w.b = append(w.b, ',')
		}
		s := evs[i].Data.Seq
		if s == 0 {
			s = seq
		}
		if s != evSeq {
			evSeq, n = s, 0
		}
		w.ceAttributes(job+"/"+strconv.FormatUint(s, 10)+"/"+strconv.Itoa(n), source, evs[i].Type, job, evs[i].Time)
		n++
		w.historyData(&evs[i].Data)
		w.close()
	}
	return append(w.b, ']')
}

// ceAttributes opens a history event and writes its context attributes
// and the "data" key, in the order and the form in which sdk-go's
// event.Event marshals them (github.com/cloudevents/sdk-go/v2/event,
// WriteJson: specversion, id, source, type, subject, datacontenttype,
// time in UTC with RFC 3339 nanoseconds), so that an event read from the
// history stream and marshalled again by sdk-go is the same bytes
// (TestHistoryEventsAreSDKGoBytes). The data follows.
func (w *jsonw) ceAttributes(id, source, typ, subject string, t time.Time) {
	w.open()
	w.strField("specversion", "1.0")
	w.strField("id", id)
	w.strField("source", source)
	w.strField("type", typ)
	w.strField("subject", subject)
	w.strField("datacontenttype", "application/json")
	w.timeField("time", t.UTC())
	w.key("data")
}

// DecodeHistory decodes one history message: a CloudEvents JSON batch.
func DecodeHistory(b []byte) ([]HistoryEvent, error) {
	var evs []HistoryEvent
	if err := json.Unmarshal(b, &evs); err != nil {
		return nil, fmt.Errorf("decode history message: %w", err)
	}
	return evs, nil
}

// jsonw appends JSON to b, tracking whether a comma is due.
type jsonw struct {
	b     []byte
	comma bool
}

func (w *jsonw) open()  { w.b = append(w.b, '{'); w.comma = false }
func (w *jsonw) close() { w.b = append(w.b, '}'); w.comma = true }

func (w *jsonw) key(k string) {
	if w.comma {
		w.b = append(w.b, ',')
	}
	w.b = append(w.b, '"')
	w.b = append(w.b, k...) // keys are plain ASCII constants
	w.b = append(w.b, '"', ':')
	w.comma = true
}

func (w *jsonw) strField(k, v string) { w.key(k); w.str(v) }
func (w *jsonw) intField(k string, v int64) {
	w.key(k)
	w.b = strconv.AppendInt(w.b, v, 10)
}
func (w *jsonw) uintField(k string, v uint64) {
	w.key(k)
	w.b = strconv.AppendUint(w.b, v, 10)
}
func (w *jsonw) boolField(k string, v bool) {
	w.key(k)
	w.b = strconv.AppendBool(w.b, v)
}
func (w *jsonw) rawField(k string, v json.RawMessage) {
	w.key(k)
	if len(v) == 0 {
		w.b = append(w.b, "null"...)
		return
	}
	w.b = append(w.b, v...)
}
func (w *jsonw) timeField(k string, t time.Time) {
	w.key(k)
	w.b = append(w.b, '"')
	w.b = t.AppendFormat(w.b, time.RFC3339Nano)
	w.b = append(w.b, '"')
}

func (w *jsonw) strMap(m map[string]string) {
	w.b = append(w.b, '{')
	for i, k := range sortedKeys(m) {
		if i > 0 {
			w.b = append(w.b, ',')
		}
		w.str(k)
		w.b = append(w.b, ':')
		w.str(m[k])
	}
	w.b = append(w.b, '}')
}

func (w *jsonw) stepRecord(r *StepRecord) {
	w.open()
	w.strField("status", string(r.Status))
	w.intField("attempts", int64(r.Attempts))
	w.intField("runs", int64(r.Runs))
	if r.RunAttempt != 0 {
		w.intField("run_attempt", int64(r.RunAttempt))
	}
	if r.ResultDigest != "" {
		w.strField("result_digest", r.ResultDigest)
	}
	if r.LastError != nil {
		w.key("last_error")
		w.error(r.LastError)
	}
	if r.DurationMs != 0 {
		w.intField("duration_ms", r.DurationMs)
	}
	if r.CompletedSeq != 0 {
		w.uintField("completed_seq", r.CompletedSeq)
	}
	w.close()
}

func (w *jsonw) dispatch(d *Dispatch) {
	w.open()
	w.strField("step", d.Step)
	w.intField("attempt", int64(d.Attempt))
	w.intField("run_attempt", int64(d.RunAttempt))
	w.strField("msg_id", d.MsgID)
	w.strField("pool", d.Pool)
	w.timeField("dispatched_at", d.DispatchedAt)
	if d.NotBefore != nil {
		w.timeField("not_before", *d.NotBefore)
	}
	if d.EffectKey != "" {
		w.strField("effect_key", d.EffectKey)
	}
	if d.Item != 0 {
		w.intField("item", int64(d.Item))
	}
	if d.Child != "" {
		w.strField("child", d.Child)
	}
	if d.Due != nil {
		w.timeField("due", *d.Due)
	}
	if d.Held {
		w.boolField("held", true)
	}
	if d.Gate != "" {
		w.strField("gate", d.Gate)
	}
	if d.Wait != "" {
		w.strField("wait", d.Wait)
	}
	if d.Slot != "" {
		w.strField("slot", d.Slot)
	}
	if d.Waiting != nil {
		b, _ := Marshal(d.Waiting)
		w.rawField("waiting", b)
	}
	w.close()
}

func (w *jsonw) error(e *Error) {
	w.open()
	w.strField("code", string(e.Code))
	if e.Message != "" {
		w.strField("message", e.Message)
	}
	if e.Job != "" {
		w.strField("job", e.Job)
	}
	if e.Step != "" {
		w.strField("step", e.Step)
	}
	if e.Attempt != 0 {
		w.intField("attempt", int64(e.Attempt))
	}
	if e.Retryable {
		w.boolField("retryable", true)
	}
	if e.RetryAfterMs != 0 {
		w.intField("retry_after_ms", e.RetryAfterMs)
	}
	w.close()
}

// event writes a checkpoint's outbox event. Its data leaves out the job,
// which is the checkpoint's own (kv.DecodeCheckpoint puts it back).
func (w *jsonw) event(ev *Event) {
	w.open()
	w.strField("type", ev.Type)
	w.timeField("time", ev.Time)
	w.key("data")
	d := ev.Data
	d.Job = ""
	w.historyData(&d)
	w.close()
}

func (w *jsonw) historyData(d *HistoryData) {
	w.open()
	if d.Job != "" {
		w.strField("job", d.Job)
	}
	w.uintField("seq", d.Seq)
	if d.Step != "" {
		w.strField("step", d.Step)
	}
	if d.Attempt != 0 {
		w.intField("attempt", int64(d.Attempt))
	}
	if d.Item != 0 {
		w.intField("item", int64(d.Item))
	}
	if d.Status != "" {
		w.strField("status", d.Status)
	}
	if d.DurationMs != 0 {
		w.intField("duration_ms", d.DurationMs)
	}
	if d.Error != nil {
		w.key("error")
		w.error(d.Error)
	}
	if d.ResultDigest != "" {
		w.strField("result_digest", d.ResultDigest)
	}
	if d.Retrying {
		w.boolField("retrying", true)
	}
	if !d.NotBefore.IsZero() {
		w.timeField("not_before", d.NotBefore)
	}
	if d.Reason != "" {
		w.strField("reason", d.Reason)
	}
	if d.Next != "" {
		w.strField("next", d.Next)
	}
	if d.NextAttempt != 0 {
		w.intField("next_attempt", int64(d.NextAttempt))
	}
	if len(d.Input) > 0 {
		w.rawField("input", d.Input)
	}
	if d.EffectKey != "" {
		w.strField("effect_key", d.EffectKey)
	}
	if d.EffectState != "" {
		w.strField("effect_state", d.EffectState)
	}
	if d.ExternalID != "" {
		w.strField("external_id", d.ExternalID)
	}
	if d.By != "" {
		w.strField("by", d.By)
	}
	if d.Turn != 0 {
		w.intField("turn", int64(d.Turn))
	}
	if d.Tool != "" {
		w.strField("tool", d.Tool)
	}
	if d.Call != "" {
		w.strField("call", d.Call)
	}
	if d.Model != "" {
		w.strField("model", d.Model)
	}
	if d.Usage != nil {
		b, _ := json.Marshal(d.Usage)
		w.rawField("usage", b)
	}
	if d.PromptVersion != "" {
		w.strField("prompt_version", d.PromptVersion)
	}
	if d.Approval != nil {
		b, _ := Marshal(d.Approval)
		w.rawField("approval", b)
	}
	if d.Signal != nil {
		b, _ := Marshal(d.Signal)
		w.rawField("signal", b)
	}
	if len(d.State) > 0 {
		w.rawField("state", d.State)
	}
	if d.ToSeq != 0 {
		w.uintField("to_seq", d.ToSeq)
	}
	if len(d.Runs) > 0 {
		b, _ := Marshal(d.Runs)
		w.rawField("runs", b)
	}
	if d.Flow != nil {
		b, _ := Marshal(d.Flow)
		w.rawField("flow", b)
	}
	w.close()
}

// str appends s as a JSON string: ", \ and control characters escaped,
// invalid UTF-8 replaced by U+FFFD, as encoding/json does (without its
// HTML escaping, which JSON does not need).
func (w *jsonw) str(s string) {
	const hex = "0123456789abcdef"
	b := append(w.b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	w.b = append(b, '"')
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// AppendEffectEvent appends a one-event CloudEvents batch describing an
// effect ledger transition (rev is the record's KV revision, which makes
// the event id "<job>/effect/<rev>" unique). A replay (EventEffectReplayed)
// reports a revision whose transition has an event of its own, so its id
// is "<job>/effect/<rev>/replayed".
func AppendEffectEvent(dst []byte, source, typ string, rec *EffectRecord, rev uint64, now time.Time) []byte {
	d := HistoryData{Job: rec.Job, Step: rec.Step, Attempt: rec.Attempt, EffectKey: rec.Key, EffectState: string(rec.State),
		ExternalID: rec.ExternalID, ResultDigest: rec.ResultDigest, Reason: rec.Reason, By: rec.ReconciledBy, Error: rec.LastError}
	id := rec.Job + "/effect/" + strconv.FormatUint(rev, 10)
	if typ == EventEffectReplayed {
		id += "/replayed"
	}
	w := jsonw{b: append(dst, '[')}
	w.ceAttributes(id, source, typ, rec.Job, now)
	w.historyData(&d)
	w.close()
	return append(w.b, ']')
}
