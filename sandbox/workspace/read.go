package workspace

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
	"unicode/utf8"

	"github.com/sbxbroker/broker/protocol"
)

// openReadFlags never block: a FIFO opened with O_NONBLOCK for reading returns at once (and is then
// refused by the fstat check), and O_NOCTTY keeps a terminal from becoming ours.
const openReadFlags = os.O_RDONLY | syscall.O_NONBLOCK | syscall.O_NOCTTY

// openRegular opens rel for reading if it is a regular file, following symlinks inside the
// workspace. It checks the type before opening (so a FIFO or device is never opened) and again on
// the open file (so a swap between the two cannot slip one through).
func (w *Workspace) openRegular(rel, sp string) (*os.File, fs.FileInfo, error) {
	// Fast path: a regular file in the root (fastOpen checks the type before opening, like the
	// path below); the type is checked again on the open file.
	f, fast, err := w.fastOpen(rel, openReadFlags, 0)
	if !fast {
		var fi fs.FileInfo
		if fi, err = w.root.Stat(rel); err != nil {
			return nil, nil, fsErr(sp, err)
		}
		if err := checkRegular(sp, fi); err != nil {
			return nil, nil, err
		}
		f, err = w.root.OpenFile(rel, openReadFlags, 0)
	}
	if err != nil {
		return nil, nil, fsErr(sp, err)
	}
	fi, err := f.Stat()
	if err == nil {
		err = checkRegular(sp, fi)
	}
	if err != nil {
		f.Close()
		return nil, nil, fsErr(sp, err)
	}
	return f, fi, nil
}

func checkRegular(sp string, fi fs.FileInfo) error {
	switch {
	case fi.IsDir():
		return protocol.Errorf(protocol.CodeIsDirectory, "%s is a directory; list it instead of reading it", sp)
	case !fi.Mode().IsRegular():
		return notRegular(sp, fi)
	}
	return nil
}

// Read is ReadContext without a deadline.
func (w *Workspace) Read(a protocol.ReadArgs) (protocol.ReadResult, error) {
	return w.ReadContext(context.Background(), a)
}

// ReadContext reads a regular file: the whole file, a byte range or a line window, cut at
// MaxReadBytes, with content that is not UTF-8 base64-encoded (ReadRaw, as JSON carries it).
func (w *Workspace) ReadContext(ctx context.Context, a protocol.ReadArgs) (protocol.ReadResult, error) {
	head, content, err := w.ReadRaw(ctx, a, nil)
	if err != nil {
		return protocol.ReadResult{}, err
	}
	return head.Result(string(content)), nil
}

// ReadRaw reads a regular file like ReadContext and returns its content as raw bytes, for an answer
// that carries them as they are (the dataplane's binary answer). A byte range is read into the
// buffer alloc(n) returns (len n; nil alloc: a new one), so a caller can read into pooled memory
// and send from it; a line window comes in a buffer of its own. A line window scans at most
// MaxScanBytes of the file, checking ctx between chunks: a window that starts past them is
// payload_too_large, one that runs past them is truncated, and a count of lines cut there says so
// (TotalLinesPartial). Content the cap cut inside a UTF-8 character loses that character's part.
func (w *Workspace) ReadRaw(ctx context.Context, a protocol.ReadArgs, alloc func(n int) []byte) (protocol.ReadHead, []byte, error) {
	if a.Offset < 0 || a.Length < 0 || a.LineOffset < 0 || a.LineLimit < 0 {
		return protocol.ReadHead{}, nil, protocol.Errorf(protocol.CodeInvalidArgument, "offset, length, line_offset and line_limit must not be negative")
	}
	lines := a.LineOffset != 0 || a.LineLimit != 0
	if lines && (a.Offset != 0 || a.Length != 0) {
		return protocol.ReadHead{}, nil, protocol.Errorf(protocol.CodeInvalidArgument, "give either a byte range (offset, length) or a line window (line_offset, line_limit), not both")
	}
	if err := ctxErr(ctx); err != nil {
		return protocol.ReadHead{}, nil, err
	}
	rel, sp, err := resolve(a.Path)
	if err != nil {
		return protocol.ReadHead{}, nil, err
	}
	f, fi, err := w.openRegular(rel, sp)
	if err != nil {
		return protocol.ReadHead{}, nil, err
	}
	defer f.Close()
	if err := fileByName(a.Path, sp, fi); err != nil {
		return protocol.ReadHead{}, nil, err
	}

	res := protocol.ReadHead{Path: sp, Size: fi.Size()}
	var content []byte
	if lines {
		sr := &scanReader{ctx: ctx, r: f, left: w.opts.MaxScanBytes}
		var lw lineWindow
		lw, err = readLines(sr, a.LineOffset, a.LineLimit, w.opts.MaxReadBytes)
		switch {
		case err != nil:
		case lw.notReached:
			return protocol.ReadHead{}, nil, protocol.Errorf(protocol.CodeTooLarge,
				"line_offset %d of %s is past the first %s of the file, which is all a line-window read scans (they hold %d lines); read further by byte range (offset, length) or run a command such as tail or sed with exec",
				a.LineOffset, sp, sizeText(w.opts.MaxScanBytes), lw.total)
		}
		content, res.TotalLines, res.TotalLinesPartial, res.Truncated = lw.out, lw.total, lw.partial, lw.truncated
	} else {
		content, res.Truncated, err = readRange(f, fi.Size(), a.Offset, a.Length, w.opts.MaxReadBytes, alloc)
	}
	if err != nil {
		if pe := (*protocol.Error)(nil); errors.As(err, &pe) {
			return protocol.ReadHead{}, nil, err
		}
		return protocol.ReadHead{}, nil, fsErr(sp, err)
	}
	if res.Truncated && !utf8.Valid(content) {
		// The cap may have split the last character of a text file: drop it rather than making
		// the whole answer binary.
		if trimmed := trimPartialRune(content); utf8.Valid(trimmed) {
			content = trimmed
		}
	}
	return res, content, nil
}

// sizeText shows a byte count the way the docs state caps: "64 MiB", or bytes.
func sizeText(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}

// errScanCap ends a scan at its byte budget; it is never returned to a caller.
var errScanCap = errors.New("scan cap reached")

// scanReader reads at most left bytes of r and then fails with errScanCap; it checks ctx before
// every read, so a scan stops within one chunk of a cancel or a client's hang-up.
type scanReader struct {
	ctx  context.Context
	r    io.Reader
	left int64
}

func (s *scanReader) Read(p []byte) (int, error) {
	if err := ctxErr(s.ctx); err != nil {
		return 0, err
	}
	if s.left <= 0 {
		return 0, errScanCap
	}
	if int64(len(p)) > s.left {
		p = p[:s.left]
	}
	n, err := s.r.Read(p)
	s.left -= int64(n)
	return n, err
}

// readRange reads [off, off+length) (length 0: to the end) of a file of the given size, at most
// capBytes bytes; truncated says the cap cut it.
func readRange(f *os.File, size, off, length, capBytes int64, alloc func(int) []byte) (_ []byte, truncated bool, _ error) {
	if off > size {
		off = size
	}
	n := size - off
	if length > 0 && length < n {
		n = length
	}
	if n > capBytes {
		n, truncated = capBytes, true
	}
	var buf []byte
	if alloc != nil {
		buf = alloc(int(n))[:n]
	} else {
		buf = make([]byte, n)
	}
	k, err := f.ReadAt(buf, off)
	if err != nil && !errors.Is(err, io.EOF) { // EOF: the file shrank since fstat; return what is there
		return nil, false, err
	}
	return buf[:k], truncated, nil
}

// lineWindow is what readLines found.
type lineWindow struct {
	out        []byte
	total      int  // lines counted (all of them unless partial)
	partial    bool // the scan stopped at its cap before the end of the file
	truncated  bool // the window was cut, by the read cap or the scan cap
	notReached bool // the scan stopped before the window's first line
}

// readLines streams r once: it keeps lines [lineOff, lineOff+limit) (limit 0: all), up to capBytes
// bytes, and counts every line, so memory stays at the cap whatever the file's size. A final line
// without a newline counts; an empty file has none. r ending with errScanCap ends the scan early:
// the count is partial, and a window it cut is truncated (at its last whole line).
func readLines(r io.Reader, lineOff, limit int, capBytes int64) (lineWindow, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var (
		lw        lineWindow
		out       []byte
		line      int  // index of the line being read
		lineStart int  // len(out) where the current line began
		partial   bool // the current line has bytes but no newline yet
		full      bool // stopped collecting: the cap was hit
	)
	for {
		chunk, err := br.ReadSlice('\n')
		if len(chunk) > 0 {
			inWindow := line >= lineOff && (limit == 0 || line-lineOff < limit)
			if inWindow && !full {
				if room := capBytes - int64(len(out)); int64(len(chunk)) <= room {
					out = append(out, chunk...)
				} else {
					full, lw.truncated = true, true
					if lineStart > 0 {
						out = out[:lineStart] // cut at the last line boundary
					} else {
						// The first line alone is over the cap: cut inside it, on a rune boundary.
						out = append(out, chunk[:room]...)
						out = trimPartialRune(out)
					}
				}
			}
			if chunk[len(chunk)-1] == '\n' {
				line++
				partial = false
				lineStart = len(out)
			} else {
				partial = true
			}
			if full || (limit != 0 && line-lineOff >= limit) {
				// Past the window: only the count is left, which needs no line splitting.
				n, last, seen, err := countLines(br)
				switch {
				case errors.Is(err, errScanCap):
					lw.partial = true
				case err != nil:
					return lineWindow{}, err
				}
				if seen {
					partial = last != '\n'
				}
				line += n
				if partial {
					line++
				}
				lw.out, lw.total = out, line
				return lw, nil
			}
		}
		switch {
		case err == nil, errors.Is(err, bufio.ErrBufferFull):
		case errors.Is(err, io.EOF), errors.Is(err, errScanCap):
			if errors.Is(err, errScanCap) {
				lw.partial = true
				switch {
				case line < lineOff || (line == lineOff && !partial):
					lw.notReached = true
				case !full:
					lw.truncated = true
					if partial && lineStart > 0 {
						out = out[:lineStart] // keep whole lines; the cut one is read on from here
					}
				}
			}
			if partial {
				line++
			}
			lw.out, lw.total = out, line
			return lw, nil
		default:
			return lineWindow{}, err
		}
	}
}

// countLines counts the newlines left in r and returns the last byte read, if any was. It returns
// r's error, errScanCap included, with the count so far.
func countLines(r io.Reader) (n int, last byte, seen bool, err error) {
	buf := make([]byte, 64<<10)
	for {
		k, err := r.Read(buf)
		if k > 0 {
			n += bytes.Count(buf[:k], []byte{'\n'})
			last, seen = buf[k-1], true
		}
		if errors.Is(err, io.EOF) {
			return n, last, seen, nil
		}
		if err != nil {
			return n, last, seen, err
		}
	}
}

// trimPartialRune drops an incomplete UTF-8 sequence at the end of b, so that cutting valid text
// keeps it valid.
func trimPartialRune(b []byte) []byte {
	for i := 1; i <= utf8.UTFMax && i <= len(b); i++ {
		if utf8.RuneStart(b[len(b)-i]) { // the start of the last rune
			if !utf8.FullRune(b[len(b)-i:]) {
				return b[:len(b)-i]
			}
			return b
		}
	}
	return b
}

// OpenRead opens a regular file for a streaming download. The reader's errors are protocol errors
// naming the sandbox path. The FileInfo describes the opened file (a symlink inside the workspace is
// followed) under the requested path.
func (w *Workspace) OpenRead(p string) (io.ReadCloser, protocol.FileInfo, error) {
	rel, sp, err := resolve(p)
	if err != nil {
		return nil, protocol.FileInfo{}, err
	}
	f, fi, err := w.openRegular(rel, sp)
	if err != nil {
		return nil, protocol.FileInfo{}, err
	}
	if err := fileByName(p, sp, fi); err != nil {
		f.Close()
		return nil, protocol.FileInfo{}, err
	}
	return &fileReader{f: f, sp: sp}, info(sp, fi, ""), nil
}

// fileReader hides the *os.File, whose Name and errors carry the host path.
type fileReader struct {
	f  *os.File
	sp string
}

func (r *fileReader) Read(p []byte) (int, error) {
	n, err := r.f.Read(p)
	if err != nil && !errors.Is(err, io.EOF) {
		err = fsErr(r.sp, err)
	}
	return n, err
}

func (r *fileReader) Close() error {
	return fsErr(r.sp, r.f.Close())
}
