// Package schemas holds the shapes that cross Waymark's boundaries, beside
// their JSON Schemas: the workflow definition and its loader, the job
// checkpoint, the step message a worker receives, the step result it sends
// back, the inbox and history messages, and the typed error that survives a
// round trip through JetStream.
//
// It imports nothing of Waymark's own. What each side does with a definition
// is its own business: the engine compiles transition conditions, workers
// compile prompt and request templates.
//
// A workflow file becomes a definition in four steps:
//
//	YAML/JSON bytes ──parse──► generic value ──workflow.schema.json──► checks
//	    (line numbers kept)        (assets embedded)      (ids, targets, schemas)
//	                                  │
//	                                  ▼
//	              canonical JSON ──sha256──► Definition.Hash (pins every job)
//
// Before parsing, text that is not Unicode (invalid UTF-8, an escaped lone
// surrogate) is refused where it stands (CheckJSONText does the same for
// inputs). The checks the loader runs for the engine and the workers see
// the state through Shape and StateShape: what the definition's schemas
// guarantee about each member, so that conditions and templates reading a
// member that cannot exist are refused at load, and those the schemas
// leave open are warnings (Problem.Warning, Definition.Warnings).
// CheckStartSize holds the size limits a job's first writes must fit.
package schemas
