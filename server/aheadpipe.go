package server

import (
	"io"
	"sync"
)

// aheadPipe is io.Pipe with a bounded buffer: Write returns once its bytes are buffered (blocking
// while the buffer is full), so the connection's reader takes the next frame while the extractor
// is still writing files of the last one, the overlap that GNU tar gets from the socket buffer.
// Memory stays at the buffer's size whatever the stream's.
type aheadPipe struct {
	mu   sync.Mutex
	cond sync.Cond
	buf  []byte // a ring: n bytes from off
	off  int
	n    int
	werr error // the writer's end: io.EOF, or why it was aborted
	rerr error // the reader's end: what further writes return
}

func newAheadPipe(size int) *aheadPipe {
	p := &aheadPipe{buf: make([]byte, size)}
	p.cond.L = &p.mu
	return p
}

func (p *aheadPipe) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	written := 0
	for len(b) > 0 {
		for p.n == len(p.buf) && p.rerr == nil && p.werr == nil {
			p.cond.Wait()
		}
		if p.rerr != nil {
			return written, p.rerr
		}
		if p.werr != nil {
			return written, io.ErrClosedPipe
		}
		end := (p.off + p.n) % len(p.buf)
		limit := len(p.buf)
		if end < p.off {
			limit = p.off
		}
		k := copy(p.buf[end:min(limit, end+len(p.buf)-p.n)], b)
		p.n += k
		written += k
		b = b[k:]
		p.cond.Broadcast()
	}
	return written, nil
}

func (p *aheadPipe) Read(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.n == 0 && p.werr == nil && p.rerr == nil {
		p.cond.Wait()
	}
	if p.rerr != nil {
		return 0, io.ErrClosedPipe
	}
	if p.n == 0 {
		return 0, p.werr
	}
	k := copy(b, p.buf[p.off:min(len(p.buf), p.off+p.n)])
	p.off = (p.off + k) % len(p.buf)
	p.n -= k
	p.cond.Broadcast()
	return k, nil
}

// CloseWrite ends the stream: the reader gets the buffered bytes, then io.EOF.
func (p *aheadPipe) CloseWrite() {
	p.mu.Lock()
	if p.werr == nil {
		p.werr = io.EOF
	}
	p.cond.Broadcast()
	p.mu.Unlock()
}

// AbortWrite drops what is buffered: the reader's next Read returns err.
func (p *aheadPipe) AbortWrite(err error) {
	p.mu.Lock()
	p.werr, p.n = err, 0
	p.cond.Broadcast()
	p.mu.Unlock()
}

// CloseRead stops the reader's side: writes return err from now on.
func (p *aheadPipe) CloseRead(err error) {
	p.mu.Lock()
	if p.rerr == nil {
		p.rerr = err
	}
	p.cond.Broadcast()
	p.mu.Unlock()
}
