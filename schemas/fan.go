package schemas

import (
	"encoding/json"
	"strconv"
	"time"
)

// Fan is a parallel or map step in flight: several dispatches of one job
// at once. Branches (parallel) are steps of their own, with step records;
// items (map) are dispatches of the map step, with Dispatch.Item set. What
// is done is kept as sets of indexes, and a map's outputs in chunks by
// reference once they grow, so that the checkpoint stays small however
// many items the list has.
type Fan struct {
	Step  string `json:"step"`  // the parallel or for_each step
	Run   int    `json:"run"`   // the step's run (Steps[Step].Runs)
	Total int    `json:"total"` // branches or items
	// Next is the number of items dispatched at least once (a map takes
	// items in order); a parallel step dispatches every branch at once.
	Next int `json:"next,omitempty"`
	// Running holds the dispatches in flight, each recorded before its
	// message is published (DESIGN.md invariant 2).
	Running []*Dispatch `json:"running,omitempty"`
	// Done, Failed and Cancelled hold indexes: of items, or of branches in
	// the order the step lists them.
	Done      StepSet   `json:"done,omitempty"`
	Failed    []FanFail `json:"failed,omitempty"`
	Cancelled StepSet   `json:"cancelled,omitempty"`
	// Decided: the join has its outcome and waits only for the branches
	// it lets finish (Join.Others wait).
	Decided bool `json:"decided,omitempty"`
	// Blocked are the items and branches whose effect may have happened,
	// each waiting for a person; the job's Blocked names the first.
	Blocked []Blocked `json:"blocked,omitempty"`
	// Outputs are map item outputs not yet in a chunk; Chunks hold the
	// others, each a JSON array of FanOutput, in the value store.
	Outputs []FanOutput `json:"outputs,omitempty"`
	Chunks  []FanChunk  `json:"chunks,omitempty"`
	// OutputBytes is the size of the outputs gathered so far, in bytes.
	OutputBytes int64 `json:"output_bytes,omitempty"`
	// Agent is the loop of an agent step: its turn dispatch (item 0) and
	// tool call dispatches (items counted over the run) are in Running.
	Agent *AgentRun `json:"agent,omitempty"`
}

// FanFail is an item or branch that failed for good.
type FanFail struct {
	Index int    `json:"i"`
	Key   string `json:"key,omitempty"` // the item's key, when named
	Error *Error `json:"error"`
}

// FanChunk names a chunk of map outputs in the value store: the digest
// ("sha256:<hex>") and size in bytes of its JSON array of FanOutput.
type FanChunk struct {
	Digest string `json:"digest"`
	Bytes  int    `json:"bytes"`
	Items  int    `json:"items"` // outputs it holds
}

// FanOutput is one map item's output.
type FanOutput struct {
	Index  int             `json:"i"`
	Output json.RawMessage `json:"o"`
}

// Dispatches returns the dispatches of cp in flight: Current, or the
// fan's; nil when none.
func (cp *Checkpoint) Dispatches() []*Dispatch {
	if cp.Fan != nil {
		return cp.Fan.Running
	}
	if cp.Current != nil {
		return []*Dispatch{cp.Current}
	}
	return nil
}

// DispatchOf returns the dispatch in flight of step's item (0 for no
// item) whose attempt is attempt, or nil.
func (cp *Checkpoint) DispatchOf(step string, item, attempt int) *Dispatch {
	for _, d := range cp.Dispatches() {
		if d.Step == step && d.Item == item && d.Attempt == attempt {
			return d
		}
	}
	return nil
}

// Running returns the fan's dispatch of step's item (0 for a branch), or
// nil and -1.
func (f *Fan) running(step string, item int) (*Dispatch, int) {
	for i, d := range f.Running {
		if d.Step == step && d.Item == item {
			return d, i
		}
	}
	return nil, -1
}

// RunningOf returns the fan's dispatch in flight of step's item (0 for a
// branch), or nil.
func (f *Fan) RunningOf(step string, item int) *Dispatch {
	d, _ := f.running(step, item)
	return d
}

// Remove drops the fan's dispatch of step's item from Running.
func (f *Fan) Remove(step string, item int) {
	if _, i := f.running(step, item); i >= 0 {
		f.Running = append(f.Running[:i:i], f.Running[i+1:]...)
	}
}

// Clone copies f deeply enough that changing the copy leaves f as it was.
func (f *Fan) Clone() *Fan {
	c := *f
	c.Running = make([]*Dispatch, len(f.Running))
	for i, d := range f.Running {
		dd := *d
		c.Running[i] = &dd
	}
	c.Failed = append([]FanFail(nil), f.Failed...)
	c.Blocked = append([]Blocked(nil), f.Blocked...)
	c.Outputs = append([]FanOutput(nil), f.Outputs...)
	c.Chunks = append([]FanChunk(nil), f.Chunks...)
	if f.Agent != nil {
		c.Agent = f.Agent.Clone()
	}
	return &c
}

// ItemMsgID returns the dedup id of a map item's step message:
// "<prefix>/<step>/r<run>.<item>/<attempt>", item counted from 1.
func ItemMsgID(prefix, step string, run, item, attempt int) string {
	return prefix + "/" + step + "/r" + itoa(run) + "." + itoa(item) + "/" + itoa(attempt)
}

// ItemIdempotencyKey derives the key of one map item's action: the step's
// key (IdempotencyKey of base, step and run) and the item's name, its key
// when the definition names one, else "item-<index>" (from 0).
func ItemIdempotencyKey(base, step string, run int, name string) string {
	return IdempotencyKey(base, step, run) + "/" + name
}

// ItemName returns the name of the item at index in keys and ledger keys:
// "item-<index>" (from 0).
func ItemName(index int) string { return "item-" + strconv.Itoa(index) }

// fanItem is a map item's dispatch as a checkpoint stores it: its step and
// pool are the fan's, its message id follows from the job's prefix
// (Fan.FillIDs), so that a thousand items in flight cost a few dozen bytes
// each.
type fanItem struct {
	Item         int    `json:"i"`
	Attempt      int    `json:"a"`
	RunAttempt   int    `json:"r"`
	DispatchedAt int64  `json:"t"`            // Unix ms
	NotBefore    int64  `json:"nb,omitempty"` // Unix ms
	EffectKey    string `json:"k,omitempty"`
}

// fanWire is Fan's encoding: branch dispatches in full, item dispatches
// compact.
type fanWire struct {
	Step        string      `json:"step"`
	Run         int         `json:"run"`
	Total       int         `json:"total"`
	Next        int         `json:"next,omitempty"`
	Running     []*Dispatch `json:"running,omitempty"`
	Pool        string      `json:"pool,omitempty"` // of the items
	Items       []fanItem   `json:"items,omitempty"`
	Done        StepSet     `json:"done,omitempty"`
	Failed      []FanFail   `json:"failed,omitempty"`
	Cancelled   StepSet     `json:"cancelled,omitempty"`
	Decided     bool        `json:"decided,omitempty"`
	Blocked     []Blocked   `json:"blocked,omitempty"`
	Outputs     []FanOutput `json:"outputs,omitempty"`
	Chunks      []FanChunk  `json:"chunks,omitempty"`
	OutputBytes int64       `json:"output_bytes,omitempty"`
	Agent       *AgentRun   `json:"agent,omitempty"`
}

// MarshalJSON encodes f with its map items' dispatches compact.
func (f *Fan) MarshalJSON() ([]byte, error) {
	w := fanWire{Step: f.Step, Run: f.Run, Total: f.Total, Next: f.Next, Done: f.Done, Failed: f.Failed, Cancelled: f.Cancelled,
		Decided: f.Decided, Blocked: f.Blocked, Outputs: f.Outputs, Chunks: f.Chunks, OutputBytes: f.OutputBytes, Agent: f.Agent}
	for _, d := range f.Running {
		if d.Item == 0 || d.Step != f.Step || d.Child != "" || (w.Pool != "" && d.Pool != w.Pool) {
			// In full: a branch, another pool's item, a tool call that is a
			// child job (the compact form has no child).
			w.Running = append(w.Running, d)
			continue
		}
		w.Pool = d.Pool
		it := fanItem{Item: d.Item, Attempt: d.Attempt, RunAttempt: d.RunAttempt, DispatchedAt: d.DispatchedAt.UnixMilli(), EffectKey: d.EffectKey}
		if d.NotBefore != nil {
			it.NotBefore = d.NotBefore.UnixMilli()
		}
		w.Items = append(w.Items, it)
	}
	return json.Marshal(w)
}

// UnmarshalJSON decodes what MarshalJSON wrote. Item dispatches come back
// without their message ids: FillIDs sets them.
func (f *Fan) UnmarshalJSON(b []byte) error {
	var w fanWire
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*f = Fan{Step: w.Step, Run: w.Run, Total: w.Total, Next: w.Next, Running: w.Running, Done: w.Done, Failed: w.Failed,
		Cancelled: w.Cancelled, Decided: w.Decided, Blocked: w.Blocked, Outputs: w.Outputs, Chunks: w.Chunks, OutputBytes: w.OutputBytes, Agent: w.Agent}
	for _, it := range w.Items {
		d := &Dispatch{Step: w.Step, Attempt: it.Attempt, RunAttempt: it.RunAttempt, Pool: w.Pool, Item: it.Item,
			DispatchedAt: time.UnixMilli(it.DispatchedAt).UTC(), EffectKey: it.EffectKey}
		if it.NotBefore != 0 {
			nb := time.UnixMilli(it.NotBefore).UTC()
			d.NotBefore = &nb
		}
		f.Running = append(f.Running, d)
	}
	return nil
}

// FillIDs sets the message ids of f's item dispatches that have none (as
// decoded), from the job's message prefix (Checkpoint.MsgPrefix).
func (f *Fan) FillIDs(prefix string) {
	for _, d := range f.Running {
		if d.Item > 0 && d.MsgID == "" {
			d.MsgID = ItemMsgID(prefix, d.Step, f.Run, d.Item, d.Attempt)
		}
	}
}
