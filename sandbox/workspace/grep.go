package workspace

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"path"
	"regexp"
	"regexp/syntax"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/protocol"
)

const (
	binarySniffBytes = 8 << 10 // a NUL in this prefix marks a file as binary
	maxMatchText     = 2000    // bytes of a matching line returned
	// clockEvery is the matching work (bytes times the matcher's cost per byte) between two looks
	// at the clock: about a millisecond of the slowest matching.
	clockEvery = 1 << 20
)

// Grep searches the regular text files under a.Path (a file or a directory, default /workspace)
// for lines matching a.Pattern: a literal string, or an RE2 expression with a.Regex. Matches come
// in tree order (see GlobContext) and then line order, at most a.MaxCount of them (0 or more than
// MaxGrepMatches: MaxGrepMatches). It skips binary files (a NUL byte in the first 8 KiB), files
// larger than MaxGrepFileBytes, FIFOs, sockets and devices, symlinked directories, and symlinked
// files that lead out of the workspace. ctx is checked between files.
func (w *Workspace) Grep(ctx context.Context, a protocol.GrepArgs) (protocol.GrepResult, error) {
	m, err := newMatcher(a)
	if err != nil {
		return protocol.GrepResult{}, err
	}
	maxCount := a.MaxCount
	switch {
	case maxCount < 0:
		return protocol.GrepResult{}, protocol.Errorf(protocol.CodeInvalidArgument, "max_count must not be negative")
	case maxCount == 0 || maxCount > w.opts.MaxGrepMatches:
		maxCount = w.opts.MaxGrepMatches
	}
	var filter *pattern
	baseOnly := false
	if a.Glob != "" {
		if filter, err = compilePattern(a.Glob); err != nil {
			return protocol.GrepResult{}, err
		}
		filter.budget(w.opts.MaxMatchWork)
		// A pattern without '/' matches file names at any depth, like "*.go" in ripgrep.
		baseOnly = !strings.Contains(a.Glob, "/")
	}

	base := a.Path
	if base == "" {
		base = Root
	}
	rel, sp, err := resolve(base)
	if err != nil {
		return protocol.GrepResult{}, err
	}
	fi, err := w.root.Stat(rel)
	if err != nil {
		return protocol.GrepResult{}, fsErr(sp, err)
	}
	if err := fileByName(base, sp, fi); err != nil {
		return protocol.GrepResult{}, err
	}
	g := &grepper{w: w, sc: w.newScan(ctx), m: m, deadline: time.Now().Add(w.opts.MaxGrepTime), max: maxCount, filter: filter, baseOnly: baseOnly,
		bytesLeft: w.opts.MaxGrepScanBytes, res: protocol.GrepResult{Matches: []protocol.GrepMatch{}}}
	switch {
	case fi.Mode().IsRegular():
		// A single file: the glob, if any, is matched against its name.
		if filter == nil || filter.accepts(filter.step(filter.start(), path.Base(rel))) {
			err = g.file(rel, fi)
		}
	case fi.IsDir():
		d, names, derr := w.openDir(rel, g.sc)
		if derr != nil {
			if isProtocolErr(derr) {
				return protocol.GrepResult{}, derr
			}
			return protocol.GrepResult{}, fsErr(sp, derr)
		}
		defer d.Close()
		var st states
		if filter != nil {
			st = filter.start()
		}
		err = g.walk(d, rel, names, st, 0)
	default:
		return protocol.GrepResult{}, notRegular(sp, fi)
	}
	if err != nil && err != errStop {
		return protocol.GrepResult{}, err
	}
	g.res.Truncated = g.res.Truncated || g.sc.cut || filter != nil && filter.spent || g.late
	return g.res, nil
}

// matcher reports whether one line (without its newline) matches.
type matcher struct {
	lit []byte         // literal, case-sensitive search
	re  *regexp.Regexp // everything else
	// cost estimates the work of matching one byte: the size of the compiled expression, what
	// RE2's NFA may step through per byte; 1 for a literal.
	cost int64
}

func newMatcher(a protocol.GrepArgs) (*matcher, error) {
	if a.Pattern == "" {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the search pattern is empty")
	}
	if !a.Regex && !a.IgnoreCase {
		return &matcher{lit: []byte(a.Pattern), cost: 1}, nil
	}
	expr := a.Pattern
	if !a.Regex {
		expr = regexp.QuoteMeta(expr)
	}
	if a.IgnoreCase {
		expr = "(?i)" + expr
	}
	re, err := regexp.Compile(expr)
	if err != nil {
		// The regexp error quotes the pattern, which the caller sent: nothing of ours leaks.
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the regular expression is invalid (RE2 syntax): %v", err)
	}
	cost := int64(1)
	if parsed, err := syntax.Parse(expr, syntax.Perl); err == nil {
		if prog, err := syntax.Compile(parsed.Simplify()); err == nil {
			cost = int64(max(1, len(prog.Inst)))
		}
	}
	return &matcher{re: re, cost: cost}, nil
}

func (m *matcher) match(line []byte) bool {
	if m.re != nil {
		return m.re.Match(line)
	}
	return bytes.Contains(line, m.lit)
}

// match matches one line within the grep's time: it reads the clock as the work grows, and a line
// whose matching alone is more work than clockEvery (a long line, or a large expression) goes
// through a reader that reads the clock as it goes and ends the line early once the time is up
// (late is set then, and the answer is no match).
func (g *grepper) match(line []byte) bool {
	if g.late {
		return false
	}
	if g.m.re != nil && int64(len(line))*g.m.cost > clockEvery {
		r := &clockedLine{g: g, line: line}
		ok := g.m.re.MatchReader(r)
		return ok && !g.late
	}
	g.spend(int64(len(line)) + 1)
	if g.late {
		return false
	}
	return g.m.match(line)
}

// spend counts the work of matching n bytes and reads the clock once enough has been done.
func (g *grepper) spend(n int64) {
	if g.work += n * g.m.cost; g.work >= clockEvery {
		g.work = 0
		if time.Now().After(g.deadline) {
			g.late = true
		}
	}
}

// clockedLine feeds one long line to an expression rune by rune, spending as it goes; once the
// grep is late it ends the line.
type clockedLine struct {
	g       *grepper
	line    []byte
	i       int
	unspent int64 // bytes read and not yet spent
}

func (r *clockedLine) ReadRune() (rune, int, error) {
	if r.i >= len(r.line) || r.g.late {
		return 0, 0, io.EOF
	}
	c, n := utf8.DecodeRune(r.line[r.i:])
	r.i += n
	if r.unspent += int64(n); r.unspent >= 256 {
		r.g.spend(r.unspent)
		r.unspent = 0
	}
	return c, n, nil
}

// mayMatch is a cheap whole-file test that rules files out before splitting them into lines.
func (m *matcher) mayMatch(data []byte) bool {
	return m.re != nil || bytes.Contains(data, m.lit)
}

type grepper struct {
	w         *Workspace
	sc        *scan
	m         *matcher
	deadline  time.Time // matching stops here (MaxGrepTime), truncated
	work      int64     // matching work since the clock was last read
	late      bool      // the deadline passed
	max       int
	filter    *pattern // nil: every file
	baseOnly  bool     // filter has one segment and is matched against base names
	bytesLeft int64    // file bytes the search may still read
	buf       []byte   // reused across files
	res       protocol.GrepResult
}

// walk searches the entries of dirRel (names already read, sorted; d is the directory); st is the
// filter's state at dirRel.
func (g *grepper) walk(d *dir, dirRel string, names []string, st states, depth int) error {
	for _, name := range names {
		if err := ctxErr(g.sc.ctx); err != nil {
			return err
		}
		var next states
		if g.filter != nil && !g.baseOnly {
			next = g.filter.step(st, name)
		}
		if g.filter != nil && g.filter.spent {
			return errStop
		}
		fi, err := d.lstat(name)
		if err != nil {
			continue // vanished since it was listed
		}
		rel := join(dirRel, name)
		switch mode := fi.Mode(); {
		case mode.IsDir():
			if depth >= maxWalkDepth || (g.filter != nil && !g.baseOnly && !g.filter.live(next)) {
				continue
			}
			sub, subNames, err := openSub(d, name, fi, g.sc)
			if err != nil {
				if isProtocolErr(err) {
					return err
				}
				continue // vanished, swapped for a link, unreadable: skip it
			}
			err = g.walk(sub, rel, subNames, next, depth+1)
			sub.Close()
			if err != nil {
				return err
			}
		case mode.IsRegular() || mode&fs.ModeSymlink != 0:
			if !g.wanted(name, next) {
				continue
			}
			if mode&fs.ModeSymlink != 0 {
				// Follow a link to a regular file inside the workspace; the root refuses the rest.
				target, err := g.w.root.Stat(rel)
				if err != nil || !target.Mode().IsRegular() {
					continue
				}
				fi = target
			}
			if err := g.file(rel, fi); err != nil {
				return err
			}
		}
		// FIFOs, sockets and devices are never opened.
	}
	return nil
}

func (g *grepper) wanted(name string, next states) bool {
	switch {
	case g.filter == nil:
		return true
	case g.baseOnly:
		return g.filter.matchSeg(0, name)
	}
	return g.filter.accepts(next)
}

// file searches one regular file. Files that vanish, change type or cannot be read are skipped
// silently: a search reports matches, not the churn of a live tree. An empty file is not opened:
// it has no line to match.
func (g *grepper) file(rel string, fi fs.FileInfo) error {
	limit := g.w.opts.MaxGrepFileBytes
	if fi.Size() > limit || fi.Size() == 0 {
		return nil
	}
	f, err := g.w.root.OpenFile(rel, openReadFlags, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	fi, err = f.Stat()
	if err != nil || !fi.Mode().IsRegular() || fi.Size() > limit {
		return nil
	}
	if fi.Size() > g.bytesLeft {
		// The search has read what one request may: stop here rather than skip, so that
		// truncated means the same as for matches (later files were not searched).
		g.res.Truncated = true
		return errStop
	}
	if int64(cap(g.buf)) < fi.Size() {
		if err := g.sc.mem.Grow(fi.Size() - int64(cap(g.buf))); err != nil {
			return err
		}
		g.buf = make([]byte, fi.Size())
	}
	n, err := io.ReadFull(f, g.buf[:fi.Size()])
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return nil
	}
	g.bytesLeft -= int64(n)
	data := g.buf[:n]
	if bytes.IndexByte(data[:min(len(data), binarySniffBytes)], 0) >= 0 || !g.m.mayMatch(data) {
		return nil
	}
	sp := sandboxPath(rel)
	for lineNo := 1; len(data) > 0; lineNo++ {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		matched := g.match(line)
		if g.late {
			return errStop
		}
		if !matched {
			continue
		}
		if len(g.res.Matches) == g.max {
			g.res.Truncated = true
			return errStop
		}
		if len(line) > maxMatchText {
			line = trimPartialRune(line[:maxMatchText])
		}
		m := protocol.GrepMatch{Path: sp, Line: lineNo, Text: strings.ToValidUTF8(string(line), "\uFFFD")}
		if err := g.sc.mem.Grow(membudget.StringCost(m.Path) + membudget.StringCost(m.Text) + 8); err != nil {
			return err
		}
		g.res.Matches = append(g.res.Matches, m)
	}
	return nil
}
