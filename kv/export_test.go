package kv

// Test hooks, reachable only from this package's tests.

// SetEpochHook makes s call hook at each stage of MarkQueues ("read",
// "published"), to hold a race open.
func SetEpochHook(s *Store, hook func(stage string)) { s.testEpochHook = hook }

// SetBeforePointerWrite makes d call hook between reading a workflow's
// name pointer and writing it.
func SetBeforePointerWrite(d *Definitions, hook func()) { d.beforePointerWrite = hook }
