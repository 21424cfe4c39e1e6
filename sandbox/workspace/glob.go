package workspace

import (
	"context"
	"errors"
	"io/fs"
	"path"
	"strings"
	"unicode/utf8"

	"github.com/sbxbroker/broker/protocol"
)

// maxWalkDepth bounds how deep Glob and Grep descend below their starting directory; deeper
// entries are skipped. It keeps a hostile, absurdly deep tree from costing unbounded recursion.
const maxWalkDepth = 256

// maxPatternSegs is the most segments a glob pattern may have (its NFA states fit in a uint64).
const maxPatternSegs = 63

// errStop ends a walk early without an error (a cap was reached).
var errStop = errors.New("stop walking")

// pattern is a compiled glob: '/'-separated segments, where "**" matches zero or more path
// segments and any other segment is matched against one name with path.Match (so '*', '?' and
// '[...]' stay within a segment, and dotfiles match like any name), after expanding its brace
// groups ("{a,b}", nested, within one segment). It runs as an NFA: a state set
// holds the pattern positions still possible, so a walk carries the state down the tree, prunes
// subtrees that cannot match, and never backtracks.
type pattern struct {
	segs []string
	// alts holds, for a segment with brace groups ("*.{ts,tsx}"), the brace-free patterns it
	// expands to; a name matches the segment when it matches any of them. nil for the others.
	alts [][]string
	// work is what matching may still spend (Options.MaxMatchWork; unbounded when never set).
	// Once it is spent nothing matches any more and spent is set: the walk stops, truncated.
	work  int64
	spent bool
}

// budget sets what matching may spend.
func (p *pattern) budget(work int64) *pattern {
	p.work = work
	return p
}

// match is path.Match, drawing on the budget when one is set.
func (p *pattern) match(pat, name string) bool {
	if p.work != 0 || p.spent {
		if p.work -= int64(len(pat)+1) * int64(len(name)+1); p.work <= 0 {
			p.work, p.spent = 0, true
			return false
		}
	}
	ok, _ := path.Match(pat, name)
	return ok
}

// states is a set of positions in pattern.segs; position len(segs) means "matched".
type states uint64

// compilePattern checks and compiles a relative glob pattern. Errors are invalid_argument.
func compilePattern(p string) (*pattern, error) {
	switch {
	case p == "":
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern is empty")
	case len(p) > protocol.MaxPathBytes:
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern is %d bytes long; the limit is %d", len(p), protocol.MaxPathBytes)
	case strings.IndexByte(p, 0) >= 0 || !utf8.ValidString(p):
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern %s contains a NUL byte or invalid UTF-8", quote(p))
	}
	parts, ok := splitSegments(p)
	if !ok {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern %s has a \"/\" inside braces; braces choose within one path segment here: write {src,lib}/*.go, not {src/*.go,lib/*.go}", quote(p))
	}
	var segs []string
	var alts [][]string
	for _, s := range parts {
		var expanded []string
		switch {
		case s == "" || s == ".":
			continue
		case s == "..":
			return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern %s contains \"..\"; set path to the directory to search instead", quote(p))
		case s == "**":
			if len(segs) > 0 && segs[len(segs)-1] == "**" {
				continue // "**/**" is "**"
			}
		default:
			var err error
			if expanded, _, err = expandBraces(s); err != nil {
				return nil, err
			}
			for _, x := range append(expanded, s) {
				if _, err := path.Match(x, ""); err != nil {
					return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern %s is malformed at %s (check its brackets and backslashes)", quote(p), quote(s))
				}
			}
		}
		segs = append(segs, s)
		alts = append(alts, expanded)
	}
	switch {
	case len(segs) == 0:
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern %s matches no file; use e.g. \"*\" or \"**/*.go\"", quote(p))
	case len(segs) > maxPatternSegs:
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern has %d segments; the limit is %d", len(segs), maxPatternSegs)
	}
	return &pattern{segs: segs, alts: alts}, nil
}

// matchSeg says name matches segment i (not "**").
func (p *pattern) matchSeg(i int, name string) bool {
	if p.alts[i] == nil {
		return p.match(p.segs[i], name)
	}
	for _, a := range p.alts[i] {
		if p.match(a, name) {
			return true
		}
	}
	return false
}

func (p *pattern) start() states { return p.closure(1) }

// closure adds the positions reachable without consuming a name: past a "**" (zero segments).
func (p *pattern) closure(s states) states {
	for i, seg := range p.segs {
		if seg == "**" && s&(1<<i) != 0 {
			s |= 1 << (i + 1)
		}
	}
	return s
}

// step consumes one path segment.
func (p *pattern) step(s states, name string) states {
	var next states
	for i, seg := range p.segs {
		if s&(1<<i) == 0 {
			continue
		}
		if seg == "**" {
			next |= 1 << i // "**" consumes the name and stays
		} else if p.matchSeg(i, name) {
			next |= 1 << (i + 1)
		}
	}
	return p.closure(next)
}

// accepts says the segments consumed so far match the whole pattern.
func (p *pattern) accepts(s states) bool { return s&(1<<len(p.segs)) != 0 }

// live says something below the segments consumed so far could still match.
func (p *pattern) live(s states) bool { return s&^(1<<len(p.segs)) != 0 }

// literalPrefix is the leading segments without glob syntax, except the last segment: the
// directory a walk can start in instead of the base.
func (p *pattern) literalPrefix() []string {
	var out []string
	for i, s := range p.segs[:len(p.segs)-1] {
		if s == "**" || p.alts[i] != nil || strings.ContainsAny(s, `*?[\`) {
			break
		}
		out = append(out, s)
	}
	return out
}

// Glob is GlobContext without a deadline.
func (w *Workspace) Glob(a protocol.GlobArgs) (protocol.GlobResult, error) {
	return w.GlobContext(context.Background(), a)
}

// GlobContext lists the files and directories matching a.Pattern under a.Path (default
// /workspace), in tree order (sorted by name within each directory, a directory before its
// contents), at most MaxGlobResults of them. An absolute pattern under /workspace ignores a.Path.
// The walk never enters a symlinked directory, though symlinks themselves are listed; a symlink
// named explicitly by a.Path or by the pattern's literal leading directories is followed if it
// stays inside the workspace.
func (w *Workspace) GlobContext(ctx context.Context, a protocol.GlobArgs) (protocol.GlobResult, error) {
	baseRel, pat := ".", a.Pattern
	if path.IsAbs(pat) {
		if pat == Root || !strings.HasPrefix(pat, Root+"/") {
			return protocol.GlobResult{}, protocol.Errorf(protocol.CodeInvalidPath, "the absolute glob pattern %s is not under %s; use a pattern under it, or a relative one", quote(pat), Root)
		}
		pat = strings.TrimPrefix(pat, Root+"/")
	} else {
		var err error
		if baseRel, err = w.baseDir(a.Path); err != nil {
			return protocol.GlobResult{}, err
		}
	}
	p, err := compilePattern(pat)
	if err != nil {
		return protocol.GlobResult{}, err
	}
	p.budget(w.opts.MaxMatchWork)
	st := p.start()
	startRel := baseRel
	for _, s := range p.literalPrefix() {
		st = p.step(st, s)
		startRel = join(startRel, s)
	}

	g := &globber{w: w, sc: w.newScan(ctx), p: p, max: w.opts.MaxGlobResults, res: protocol.GlobResult{Files: []protocol.FileInfo{}}}
	d, names, err := w.openDir(startRel, g.sc)
	switch {
	case err == nil:
	case isProtocolErr(err):
		return protocol.GlobResult{}, err
	case startRel != baseRel && (errors.Is(err, fs.ErrNotExist) || isNotDir(err)):
		return g.res, nil // the pattern's literal directory is not there: no match
	default:
		return protocol.GlobResult{}, fsErr(sandboxPath(startRel), err)
	}
	defer d.Close()
	if err := g.walk(d, startRel, names, st, 0); err != nil && err != errStop {
		return protocol.GlobResult{}, err
	}
	g.res.Truncated = g.res.Truncated || g.sc.cut || p.spent
	return g.res, nil
}

// isProtocolErr says err is already a protocol error (a cancel, a timeout), to pass on as it is.
func isProtocolErr(err error) bool {
	var pe *protocol.Error
	return errors.As(err, &pe)
}

// baseDir resolves the directory argument of Glob and Grep (default /workspace) and checks it is
// one.
func (w *Workspace) baseDir(p string) (string, error) {
	if p == "" {
		p = Root
	}
	rel, sp, err := resolve(p)
	if err != nil {
		return "", err
	}
	fi, err := w.root.Stat(rel)
	if err != nil {
		return "", fsErr(sp, err)
	}
	if !fi.IsDir() {
		return "", protocol.Errorf(protocol.CodeNotDirectory, "%s is not a directory; give a directory as path", sp)
	}
	return rel, nil
}

type globber struct {
	w   *Workspace
	sc  *scan
	p   *pattern
	max int
	res protocol.GlobResult
}

// walk visits the entries of dirRel (names already read, sorted; d is the directory) with st the
// pattern state at dirRel.
func (g *globber) walk(d *dir, dirRel string, names []string, st states, depth int) error {
	for _, name := range names {
		if err := ctxErr(g.sc.ctx); err != nil {
			return err
		}
		next := g.p.step(st, name)
		if g.p.spent {
			return errStop
		}
		accept, descend := g.p.accepts(next), g.p.live(next) && depth < maxWalkDepth
		if !accept && !descend {
			continue // nothing here can match: not even an lstat
		}
		fi, err := d.lstat(name)
		if err != nil {
			continue // vanished since it was listed
		}
		rel := join(dirRel, name)
		if accept {
			if len(g.res.Files) == g.max {
				g.res.Truncated = true
				return errStop
			}
			e := g.w.describe(rel, sandboxPath(rel), fi)
			if err := g.sc.mem.Grow(infoCost(e)); err != nil {
				return err
			}
			g.res.Files = append(g.res.Files, e)
		}
		// fi is an lstat: a symlink to a directory is not IsDir, so it is never entered.
		if fi.IsDir() && descend {
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
		}
	}
	return nil
}

// ctxErr maps a done context to the protocol's cancelled or timeout.
func ctxErr(ctx context.Context) error {
	switch err := ctx.Err(); {
	case err == nil:
		return nil
	case errors.Is(err, context.DeadlineExceeded):
		return protocol.Errorf(protocol.CodeTimeout, "the operation ran out of time; narrow it (a smaller window, path or pattern) and retry")
	default:
		return protocol.Errorf(protocol.CodeCancelled, "the operation was cancelled")
	}
}
