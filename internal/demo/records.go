package demo

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"time"
)

const recordsFile = "records.jsonl"

// Record is one written record: one line of DIR/records.jsonl, and the
// answer to PUT and GET /v1/records/{key}.
type Record struct {
	Key       string          `json:"key"`        // the path key, unescaped
	ID        string          `json:"id"`         // "rec_000001", ... in order, across restarts
	Body      json.RawMessage `json:"body"`       // the PUT body, canonical JSON
	CreatedAt time.Time       `json:"created_at"` // UTC
}

// RecordList is the answer to GET /v1/records.
type RecordList struct {
	Records []Record `json:"records"`
}

// NewRecords opens the records service, a lookup effect: a write happens
// once per key, and a caller that lost the answer asks by key whether it
// happened. Routes:
//
//	PUT /v1/records/{key}  write once; the body is any JSON value
//	GET /v1/records/{key}  Record, or 404 CodeNotFound: "did my write happen?"
//	GET /v1/records        RecordList, in order
//
// {key} is the rest of the path, unescaped, so "job/step" and "job%2Fstep"
// name the same record; 1 to MaxKeyBytes bytes. PUT answers 201 and the
// Record when it wrote; 200 and the existing Record when the key holds the
// same canonical body (nothing written); 409 CodeRecordConflict when it
// holds another body (nothing changed); 409 CodeIdempotencyKeyInUse while
// another PUT of the key runs; 400 for a bad key or body.
func NewRecords(opts Options) (*Service, error) { return New(NameRecords, opts) }

type records struct {
	s     *Service
	data  *journal
	list  []Record
	byKey map[string]int
}

func recordID(i int) string { return fmt.Sprintf("rec_%06d", i+1) }

func (rs *records) open(s *Service, dir string) error {
	rs.s, rs.byKey = s, map[string]int{}
	path := filepath.Join(dir, recordsFile)
	j, err := replayJournal(s, path, func(_ line, rec Record) error {
		if want := recordID(len(rs.list)); rec.ID != want {
			return fmt.Errorf("record id %q; want %q", rec.ID, want)
		}
		if _, dup := rs.byKey[rec.Key]; dup {
			return fmt.Errorf("key %q written twice", rec.Key)
		}
		// The stored body is canonical unless someone edited the file;
		// comparisons need it canonical.
		body, err := canonical(rec.Body)
		if err != nil {
			return err
		}
		rec.Body = body
		rs.byKey[rec.Key] = len(rs.list)
		rs.list = append(rs.list, rec)
		s.effectN[rec.Key]++
		return nil
	})
	rs.data = j
	return err
}

func (rs *records) key(r *http.Request) (string, *httpError) {
	key, ok := strings.CutPrefix(r.URL.EscapedPath(), "/v1/records/")
	if !ok {
		return "", badRequest("no record key in path %q", r.URL.Path)
	}
	key, err := url.PathUnescape(key)
	if err != nil {
		return "", badRequest("record key in path %q: %v", r.URL.EscapedPath(), err)
	}
	if herr := checkKey("record key", key); herr != nil {
		return "", herr
	}
	return key, nil
}

func (rs *records) effectKey(r *http.Request) (string, bool) {
	if r.Method != http.MethodPut || !strings.HasPrefix(r.URL.Path, "/v1/records/") {
		return "", false
	}
	if key, err := rs.key(r); err == nil {
		return key, true
	}
	return noKey, true
}

func (rs *records) serve(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/v1/records":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET, HEAD")
			return
		}
		rs.s.mu.Lock()
		list := RecordList{Records: append([]Record{}, rs.list...)}
		rs.s.mu.Unlock()
		writeJSON(w, http.StatusOK, list)
	case strings.HasPrefix(r.URL.Path, "/v1/records/"):
		switch r.Method {
		case http.MethodPut:
			rs.put(w, r)
		case http.MethodGet, http.MethodHead:
			rs.get(w, r)
		default:
			methodNotAllowed(w, "GET, HEAD, PUT")
		}
	default:
		notFound(w, r)
	}
}

func (rs *records) get(w http.ResponseWriter, r *http.Request) {
	key, herr := rs.key(r)
	if herr != nil {
		writeError(w, herr)
		return
	}
	rs.s.mu.Lock()
	i, ok := rs.byKey[key]
	var rec Record
	if ok {
		rec = rs.list[i]
	}
	rs.s.mu.Unlock()
	if !ok {
		writeError(w, errorf(http.StatusNotFound, CodeNotFound, "no record with key %q", key))
		return
	}
	writeJSON(w, http.StatusOK, rec)
}

func (rs *records) put(w http.ResponseWriter, r *http.Request) {
	key, herr := rs.key(r)
	if herr != nil {
		writeError(w, herr)
		return
	}
	data, herr := readBody(w, r)
	if herr != nil {
		writeError(w, herr)
		return
	}
	if len(bytes.TrimSpace(data)) == 0 {
		writeError(w, badRequest("request body is empty; want a JSON value"))
		return
	}
	body, err := canonical(data)
	if err != nil {
		writeError(w, decodeError(err))
		return
	}
	rs.s.run(w, r, effect{
		key:       key,
		exclusive: true,
		decided: func() (outcome, *httpError, bool) {
			i, ok := rs.byKey[key]
			if !ok {
				return outcome{}, nil, false
			}
			rec := rs.list[i]
			if !bytes.Equal(rec.Body, body) {
				return outcome{}, errorf(http.StatusConflict, CodeRecordConflict,
					"record %q exists (id %s, created %s) with a different body; it was not changed",
					key, rec.ID, rec.CreatedAt.Format(time.RFC3339)), true
			}
			b, _ := marshal(rec)
			return outcome{status: http.StatusOK, body: b}, nil, true
		},
		commit: func() (outcome, error) {
			rec := Record{Key: key, ID: recordID(len(rs.list)), Body: body, CreatedAt: rs.s.opts.Now().UTC()}
			if err := rs.data.append(rec); err != nil {
				return outcome{}, err
			}
			rs.byKey[key] = len(rs.list)
			rs.list = append(rs.list, rec)
			b, _ := marshal(rec)
			return outcome{status: http.StatusCreated, body: b, performed: true}, nil
		},
	})
}

func (rs *records) close() error { return rs.data.close() }
