package demo

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// journal is an append-only file of JSON lines. An append is one write of
// whole lines followed by fsync, so an acknowledged record survives a crash
// of the process and of the machine. A crash during the write can leave a
// torn last line, which was never acknowledged; opening cuts it off.
type journal struct {
	path string
	f    *os.File
	size int64 // bytes known good; an append that fails is cut back to it
}

// line is one line of a journal as read at open.
type line struct {
	no   int   // 1-based line number, for messages
	off  int64 // offset of its first byte
	data []byte
}

// replayJournal opens the journal at path (see openJournal), reporting a
// torn last line it cut off as a repair of s, and hands each line, decoded
// as a T, to each in order. A line that does not decode, or that each
// refuses, makes the file corrupt: ErrCorrupt naming the file and line, and
// the journal is closed.
func replayJournal[T any](s *Service, path string, each func(l line, v T) error) (*journal, error) {
	j, lines, torn, err := openJournal(path)
	if err != nil {
		return nil, err
	}
	if torn {
		s.repaired(path, "a torn last line")
	}
	for _, l := range lines {
		var v T
		err := json.Unmarshal(l.data, &v)
		if err == nil {
			err = each(l, v)
		}
		if err != nil {
			_ = j.close()
			return nil, fmt.Errorf("%w: %s line %d: %v", ErrCorrupt, path, l.no, err)
		}
	}
	return j, nil
}

// openJournal opens or creates path and returns its complete lines (blank
// lines skipped). torn reports whether an incomplete last line was cut off.
func openJournal(path string) (j *journal, lines []line, torn bool, err error) {
	_, statErr := os.Stat(path)
	created := errors.Is(statErr, fs.ErrNotExist)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, nil, false, fmt.Errorf("open %s: %w", path, err)
	}
	j = &journal{path: path, f: f}
	fail := func(err error) (*journal, []line, bool, error) {
		_ = f.Close()
		return nil, nil, false, err
	}
	if created {
		// The new file's directory entry must be durable too, or a machine
		// crash could lose the whole file after its first fsync.
		if err := syncDir(filepath.Dir(path)); err != nil {
			return fail(err)
		}
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return fail(fmt.Errorf("read %s: %w", path, err))
	}
	var off int64
	for n := 1; len(data) > 0; n++ {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			if err := j.truncate(off); err != nil {
				return fail(err)
			}
			torn = true
			break
		}
		if l := bytes.TrimSpace(data[:i]); len(l) > 0 {
			lines = append(lines, line{no: n, off: off, data: l})
		}
		off += int64(i + 1)
		data = data[i+1:]
	}
	j.size = off
	return j, lines, torn, nil
}

// append writes recs as JSON lines in one write, then fsyncs. On error the
// file is cut back to its previous size, so nothing of recs remains.
func (j *journal) append(recs ...any) error {
	if j.f == nil {
		return ErrClosed
	}
	var b bytes.Buffer
	for _, rec := range recs {
		data, err := marshal(rec)
		if err != nil {
			return fmt.Errorf("encode record for %s: %w", j.path, err)
		}
		b.Write(data)
		b.WriteByte('\n')
	}
	n, err := j.f.Write(b.Bytes())
	if err == nil {
		err = j.f.Sync()
	}
	if err != nil {
		if n > 0 {
			if terr := j.truncate(j.size); terr != nil {
				return fmt.Errorf("append to %s: %w (and cutting back failed: %v)", j.path, err, terr)
			}
		}
		return fmt.Errorf("append to %s: %w", j.path, err)
	}
	j.size += int64(n)
	return nil
}

// truncate cuts the file to size bytes and fsyncs it.
func (j *journal) truncate(size int64) error {
	if err := j.f.Truncate(size); err != nil {
		return fmt.Errorf("truncate %s to %d bytes: %w", j.path, size, err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", j.path, err)
	}
	j.size = size
	return nil
}

func (j *journal) close() error {
	if j == nil || j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	if err != nil {
		return fmt.Errorf("close %s: %w", j.path, err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}
