//go:build linux

package tartree

import (
	"context"
	"hash/fnv"
	"io"
	"io/fs"
	"path"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// The files of an archive are written behind its reading: the stream is read, checked and each
// file's bytes taken into memory in order, while a few goroutines make the files (create, write,
// owner, mode, mtime, close: six system calls each, most of a push's time when they were done one
// after the other between reads). What the archive promises stays the same:
//
//   - every name is checked, and every refusal made, by the reading loop, in order, before
//     anything of that entry is handed on; a refused entry stops the reading, and what was handed
//     on before it is written, as it was before;
//   - a writer creates a file exactly as the reading loop did, relative to a directory descriptor
//     opened without following links, with O_CREAT|O_EXCL|O_NOFOLLOW, so no link is ever written
//     through, whoever put it there and whenever;
//   - the files of one directory go to one writer, in the archive's order, so that a name given
//     twice ends as its last entry;
//   - everything else that changes the tree (a directory made or a link in its way replaced, a
//     symbolic or hard link, a file too large to hold, the directories' modes and mtimes at the
//     end) waits until every file handed on before it is written (flush), so it sees the tree the
//     archive made up to there.
//
// Memory stays bounded: at most maxInFlight bytes of buffers are held, and a file over maxQueued
// bytes is written by the reading loop itself.

// maxQueued is the largest file handed to the writers; maxInFlight bounds the bytes their buffers hold.
const (
	maxQueued   = 1 << 20
	maxInFlight = 8 << 20
)

// dirRef is a directory descriptor shared by the current-directory slot and the files in flight
// in it: it is closed when the last of them lets go.
type dirRef struct {
	fd   int
	refs atomic.Int32
}

func newDirRef(fd int) *dirRef {
	d := &dirRef{fd: fd}
	d.refs.Store(1)
	return d
}

func (d *dirRef) hold() *dirRef { d.refs.Add(1); return d }

func (d *dirRef) release() {
	if d.refs.Add(-1) == 0 {
		unix.Close(d.fd)
	}
}

// job is one file to write.
type job struct {
	ctx   context.Context
	t     *fdTree
	dir   *dirRef
	name  string
	data  []byte
	perm  fs.FileMode
	mtime time.Time
}

// writers are the goroutines writing an extraction's files; the zero value starts them when the
// first file comes.
type writers struct {
	queues  []chan job
	pending sync.WaitGroup // the files handed on and not yet written
	running sync.WaitGroup // the goroutines

	mu       sync.Mutex
	cond     sync.Cond
	inFlight int64 // bytes held by jobs: their buffers' capacity
	err      error // the first file that could not be written
}

func (w *writers) start() {
	n := min(max(runtime.GOMAXPROCS(0), 2), 4)
	w.cond.L = &w.mu
	w.queues = make([]chan job, n)
	for i := range w.queues {
		q := make(chan job, 64)
		w.queues[i] = q
		w.running.Add(1)
		go func() {
			defer w.running.Done()
			for j := range q {
				w.write(j)
			}
		}()
	}
}

// queue takes the size bytes of r into memory and hands them to the writer of the directory d.
func (w *writers) queue(ctx context.Context, t *fdTree, d *dirRef, name string, r io.Reader, size int64, perm fs.FileMode, mtime time.Time) (int64, error) {
	if w.queues == nil {
		w.start()
	}
	// What is held is the buffer, a power of two: counting the entry's size instead let files just
	// over a power of two hold nearly twice maxInFlight.
	need := int64(1) << class(int(size))
	w.mu.Lock()
	for w.inFlight > 0 && w.inFlight+need > maxInFlight && w.err == nil {
		if testHookFull != nil {
			testHookFull()
		}
		w.cond.Wait()
	}
	err := w.err
	if err == nil {
		w.inFlight += need
	}
	w.mu.Unlock()
	if err != nil {
		return 0, err
	}
	data := getBuf(int(size))
	n, err := io.ReadFull(r, data)
	if err == nil {
		// The entry must end where its header says (archive/tar reports a short one as
		// io.ErrUnexpectedEOF above; this is more data than announced, which it never gives).
		var one [1]byte
		if k, _ := r.Read(one[:]); k != 0 {
			err = io.ErrUnexpectedEOF
		}
	}
	if err != nil {
		w.done(data)
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		if ctx.Err() != nil {
			return int64(n), ctx.Err()
		}
		return int64(n), readErr(err)
	}
	// By the directory's name, so that the files of one directory keep their order whenever the
	// archive comes back to it.
	h := fnv.New32a()
	io.WriteString(h, path.Dir(name))
	w.pending.Add(1)
	w.queues[h.Sum32()%uint32(len(w.queues))] <- job{ctx: ctx, t: t, dir: d.hold(), name: name, data: data, perm: perm, mtime: mtime}
	return size, nil
}

func (w *writers) write(j job) {
	defer w.pending.Done()
	defer j.dir.release()
	defer w.done(j.data)
	if testHookWrite != nil {
		testHookWrite()
	}
	if w.failed() != nil {
		return // the extraction is failing: nothing more is written
	}
	err := j.ctx.Err()
	if err == nil {
		_, err = j.t.write(j.ctx, j.dir.fd, j.name, nil, j.data, j.perm, j.mtime, nil)
	}
	if err != nil {
		w.mu.Lock()
		if w.err == nil {
			w.err = err
		}
		w.cond.Broadcast()
		w.mu.Unlock()
	}
}

// done gives back a job's buffer.
func (w *writers) done(data []byte) {
	size := int64(cap(data))
	putBuf(data)
	w.mu.Lock()
	w.inFlight -= size
	w.cond.Broadcast()
	w.mu.Unlock()
}

// failed is the first error of writing a file, or nil.
func (w *writers) failed() error {
	if w.queues == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// flush waits until every file handed on is written and returns the first error of writing one.
func (w *writers) flush() error {
	if w.queues == nil {
		return nil
	}
	w.pending.Wait()
	return w.failed()
}

// stop ends the goroutines, once the files handed on are written (or skipped after an error).
func (w *writers) stop() {
	if w.queues == nil {
		return
	}
	for _, q := range w.queues {
		close(q)
	}
	w.running.Wait()
	w.queues = nil
}

// Buffers for the files' bytes, by power-of-two size class up to maxQueued.
var bufPools [21]sync.Pool

// bufHeld is the capacity of the buffers given out and not yet given back (the tests read it).
var bufHeld atomic.Int64

// The tests' hooks: before each file a writer writes, and whenever the reading loop waits for
// room.
var testHookWrite, testHookFull func()

func class(n int) int {
	c := 0
	for 1<<c < n {
		c++
	}
	return c
}

func getBuf(n int) []byte {
	c := class(n)
	bufHeld.Add(1 << c)
	if b, ok := bufPools[c].Get().(*[]byte); ok {
		return (*b)[:n]
	}
	return make([]byte, n, 1<<c)
}

func putBuf(b []byte) {
	bufHeld.Add(-int64(cap(b)))
	c := class(cap(b))
	if c < len(bufPools) && cap(b) == 1<<c {
		b = b[:0]
		bufPools[c].Put(&b)
	}
}
