package schemas

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
)

// StepMessageRoom is what a step message keeps for its headers (job, step,
// attempt, vars, trace context): the engine dispatches a state of at most
// MaxMessageBytes minus this many bytes.
const StepMessageRoom = 8192

// startSlack covers what a job's first checkpoints carry besides the
// state and the job.started event, which a client cannot know exactly: a
// resume recorded if the start is redelivered, timestamps of another
// length, and the small events of the next transitions, which stay in the
// checkpoint (its outbox) with job.started until the engine publishes
// them as one history batch (engine.Config.HistoryBatch, 8 transitions by
// default). A start accepted here is not refused by the engine, and its
// first steps do not fail for want of a few hundred bytes.
const startSlack = 8192

// SizeLimits are the byte limits of one deployment, as its layout sets them
// (kv.Config.MaxValueBytes and MaxMessageBytes after defaults).
type SizeLimits struct {
	MaxValueBytes   int // one checkpoint or effect record
	MaxMessageBytes int // one message on the work, inbox or history stream
}

// CheckStartSize refuses a job start whose first writes could not be
// stored or published under lim, before anything is stored. pending is the
// job's first checkpoint as the client builds it (status pending, the
// compact input as its state, vars pinned) and req the start request. When
// an engine starts the job it writes, and each must fit:
//
//   - the start request (the input and vars) on the inbox stream;
//   - the first running checkpoint: the input as the state, plus the
//     job.started event, which carries the input again until it is
//     published to history;
//   - the job.started history message (the input once more);
//   - the first step message, whose body is the state (at most
//     MaxMessageBytes - StepMessageRoom).
//
// The error is a *Error of CodeTooLarge (errors.Is(err, ErrTooLarge))
// naming the job, the input's size, the size that does not fit, its limit
// and the largest input that would.
func CheckStartSize(def *Definition, req *StartRequest, pending *Checkpoint, lim SizeLimits) error {
	in := len(pending.State)
	type bound struct {
		what        string
		size, limit int
		fits        int // the largest input under this bound
		setting     string
	}
	first := firstCheckpoint(def, pending)
	cpSize := len(first.AppendJSON(nil)) + startSlack
	histSize := len(AppendHistoryBatch(nil, strings.Repeat("x", 64), pending.JobID, first.Seq, first.Events)) + startSlack
	reqData, err := Marshal(req)
	if err != nil {
		return Errorf(CodeInputInvalid, "encode start request of job %s: %v", pending.JobID, err)
	}
	bounds := []bound{
		// The input appears twice (the state, job.started); the rest is fixed.
		{"the job's first checkpoint (the input as its state, and again in the job.started event)",
			cpSize, lim.MaxValueBytes, (lim.MaxValueBytes - (cpSize - 2*in)) / 2, "max_value_bytes"},
		{"the first step message (the state)",
			in, lim.MaxMessageBytes - StepMessageRoom, lim.MaxMessageBytes - StepMessageRoom, "max_message_bytes, less 8 KiB for headers"},
		{"the job.started history message",
			histSize, lim.MaxMessageBytes, lim.MaxMessageBytes - (histSize - in), "max_message_bytes"},
		// encoding/json escapes <, > and & in the input: the request can
		// be larger than the input.
		{"the start request", len(reqData), lim.MaxMessageBytes, lim.MaxMessageBytes - (len(reqData) - in), "max_message_bytes"},
	}
	fits := in
	var over *bound
	for i := range bounds {
		fits = min(fits, bounds[i].fits)
		if over == nil && bounds[i].size > bounds[i].limit {
			over = &bounds[i]
		}
	}
	if over == nil {
		return nil
	}
	// Leave room for another job id, vars or timestamps: a round number
	// said to fit must fit.
	fits = max(fits-1024, 0) / 1024 * 1024
	return &Error{Code: CodeTooLarge, Job: pending.JobID, Message: fmt.Sprintf(
		"input is %d bytes: %s would be %d bytes, over the limit of %d (%s); an input of up to about %d bytes fits. Members longer than the value threshold (WAYMARK_VALUE_THRESHOLD) are stored apart and do not count: keep large values in members of their own",
		in, over.what, over.size, over.limit, over.setting, fits)}
}

// firstCheckpoint returns what an engine writes when it starts the pending
// job: running, the start step dispatched, the job.started and
// step.dispatched events pending publication.
func firstCheckpoint(def *Definition, pending *Checkpoint) *Checkpoint {
	cp := *pending
	cp.Vars = maps.Clone(pending.Vars)
	start := def.StartStep()
	step := def.Step(start)
	cp.Seq++
	cp.Status = JobRunning
	cp.Writer = strings.Repeat("x", 22) // a nuid
	cp.Steps = map[string]*StepRecord{start: {Status: StepDispatched, Attempts: 1, Runs: 1, RunAttempt: 1}}
	pool := DefaultPool
	if step != nil {
		pool = def.PoolOf(step)
	}
	cp.Current = &Dispatch{Step: start, Attempt: 1, RunAttempt: 1, MsgID: StepMsgID(cp.JobID, start, 1), Pool: pool, DispatchedAt: cp.CreatedAt}
	cp.Events = []Event{
		{Type: EventJobStarted, Time: cp.CreatedAt, Data: HistoryData{Job: cp.JobID, Seq: cp.Seq, Status: string(JobRunning), Input: cp.State}},
		{Type: EventStepDispatched, Time: cp.CreatedAt, Data: HistoryData{Job: cp.JobID, Seq: cp.Seq, Step: start, Attempt: 1, Status: string(StepDispatched)}},
	}
	return &cp
}

// CheckStartText refuses a job start whose input or vars hold text that
// is not Unicode (see CheckJSONText): a *Error of CodeInputInvalid naming
// the path (/input/..., /vars/NAME), with a *TextError as its cause.
func CheckStartText(input json.RawMessage, vars map[string]string) error {
	if err := CheckJSONText(input); err != nil {
		var te *TextError
		if errors.As(err, &te) {
			c := *te
			c.Path = "/input" + te.Path
			return (&Error{Code: CodeInputInvalid, Message: c.Error()}).WithCause(&c)
		}
		return err
	}
	return CheckStringsText("/vars", vars)
}

// CheckResolutionText refuses an effect resolution whose result, external
// id, author or note holds text that is not Unicode (see CheckJSONText): a
// *Error of CodeInputInvalid naming the field (/result/..., /external_id,
// /by, /note), with a *TextError as its cause.
func CheckResolutionText(r EffectResolution) error {
	if len(r.Result) > 0 {
		if err := CheckJSONText(r.Result); err != nil {
			var te *TextError
			if errors.As(err, &te) {
				c := *te
				c.Path = "/result" + te.Path
				return (&Error{Code: CodeInputInvalid, Message: c.Error()}).WithCause(&c)
			}
			return err
		}
	}
	if err := CheckStringsText("", map[string]string{"external_id": r.ExternalID, "by": r.By, "note": r.Note}); err != nil {
		return err
	}
	return nil
}
