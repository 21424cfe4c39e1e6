package workspace

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// searchTree lays out a small tree shared by the Glob and Grep tests.
func searchTree(t *testing.T, opts Options) (*Workspace, string) {
	w, dir := newWS(t, opts)
	put(t, dir, "a.go", "package a\n// TODO: one\n")
	put(t, dir, "b.txt", "todo lower\r\nTODO crlf\r\n")
	put(t, dir, ".hidden.go", "TODO hidden\n")
	put(t, dir, "src/x.go", "func x() {}\n// TODO: x\n")
	put(t, dir, "src/sub/y.go", "TODO y1\nnothing\nTODO y2\n")
	put(t, dir, "src/sub/z.txt", "TODO z\n")
	put(t, dir, "bin.dat", "TODO\x00binary\n")
	put(t, dir, "[lit]/q.go", "TODO bracket dir\n")
	symlink(t, "src", filepath.Join(dir, "srclink"))       // a symlinked directory: never walked
	symlink(t, "src/x.go", filepath.Join(dir, "xlink.go")) // a symlinked file inside: grep follows it
	return w, dir
}

func paths(files []protocol.FileInfo) string {
	var out []string
	for _, f := range files {
		out = append(out, strings.TrimPrefix(f.Path, "/workspace/"))
	}
	return strings.Join(out, " ")
}

func TestGlob(t *testing.T) {
	t.Parallel()
	w, dir := searchTree(t, Options{})
	tests := []struct {
		args  protocol.GlobArgs
		want  string
		code  string
		trunc bool
	}{
		{args: protocol.GlobArgs{Pattern: "*.go"}, want: ".hidden.go a.go xlink.go"},
		{args: protocol.GlobArgs{Pattern: "**/*.go"}, want: ".hidden.go [lit]/q.go a.go src/sub/y.go src/x.go xlink.go"},
		{args: protocol.GlobArgs{Pattern: "src/**"}, want: "src/sub src/sub/y.go src/sub/z.txt src/x.go"},
		{args: protocol.GlobArgs{Pattern: "src/**/*.txt"}, want: "src/sub/z.txt"},
		{args: protocol.GlobArgs{Pattern: "**/sub"}, want: "src/sub"},
		{args: protocol.GlobArgs{Pattern: "s?c/*.go"}, want: "src/x.go"},
		{args: protocol.GlobArgs{Pattern: "[ab].*"}, want: "a.go b.txt"},
		{args: protocol.GlobArgs{Pattern: "*.go", Path: "/workspace/src"}, want: "src/x.go"},
		{args: protocol.GlobArgs{Pattern: "**/*.go", Path: "src"}, want: "src/sub/y.go src/x.go"},
		{args: protocol.GlobArgs{Pattern: "q.go", Path: "[lit]"}, want: "[lit]/q.go"}, // Path is a name, not a pattern
		{args: protocol.GlobArgs{Pattern: "/workspace/src/*.go", Path: "elsewhere"}, want: "src/x.go"},
		{args: protocol.GlobArgs{Pattern: "srclink/*.go"}, want: "srclink/x.go"}, // named explicitly: followed
		{args: protocol.GlobArgs{Pattern: "nope/*.go"}, want: ""},
		{args: protocol.GlobArgs{Pattern: "a.go/*"}, want: ""},
		{args: protocol.GlobArgs{Pattern: "**"}, want: ".hidden.go [lit]", trunc: true},
		{args: protocol.GlobArgs{Pattern: "*.{go,txt}"}, want: ".hidden.go a.go b.txt xlink.go"},
		{args: protocol.GlobArgs{Pattern: "{src,nope}/**/*.{txt,md}"}, want: "src/sub/z.txt"},
		{args: protocol.GlobArgs{Pattern: "src/{sub/y,x}.go"}, code: protocol.CodeInvalidArgument}, // a brace choosing across segments
		{args: protocol.GlobArgs{Pattern: "["}, code: protocol.CodeInvalidArgument},
		{args: protocol.GlobArgs{Pattern: ""}, code: protocol.CodeInvalidArgument},
		{args: protocol.GlobArgs{Pattern: "../*"}, code: protocol.CodeInvalidArgument},
		{args: protocol.GlobArgs{Pattern: "/etc/*"}, code: protocol.CodeInvalidPath},
		{args: protocol.GlobArgs{Pattern: "*", Path: "../"}, code: protocol.CodeInvalidPath},
		{args: protocol.GlobArgs{Pattern: "*", Path: "a.go"}, code: protocol.CodeNotDirectory},
		{args: protocol.GlobArgs{Pattern: "*", Path: "missing"}, code: protocol.CodeFileNotFound},
	}
	for _, tt := range tests {
		ws := w
		if tt.trunc {
			ws, _ = Open(dir, Options{MaxGlobResults: 2})
			defer ws.Close()
		}
		got, err := ws.Glob(tt.args)
		wantCode(t, err, tt.code, dir)
		if tt.code != "" {
			continue
		}
		if p := paths(got.Files); p != tt.want || got.Truncated != tt.trunc {
			t.Errorf("Glob(%+v) = %q truncated %v, want %q truncated %v", tt.args, p, got.Truncated, tt.want, tt.trunc)
		}
	}

	got, err := w.Glob(protocol.GlobArgs{Pattern: "**"})
	wantCode(t, err, "", dir)
	for _, f := range got.Files {
		if strings.HasPrefix(f.Path, "/workspace/srclink/") {
			t.Errorf("** descended into a symlinked directory: %s", f.Path)
		}
		if f.Path == "/workspace/srclink" && (f.Type != protocol.FileTypeSymlink || f.Target != "src") {
			t.Errorf("the symlink is described as %+v", f)
		}
	}
	if len(got.Files) != 13 {
		t.Errorf("** found %d entries: %s", len(got.Files), paths(got.Files))
	}
}

func TestGlobPattern(t *testing.T) {
	t.Parallel()
	tests := []struct {
		pattern, path string
		want          bool
	}{
		{"**", "a", true},
		{"**", "a/b/c", true},
		{"**/x", "x", true},
		{"**/x", "a/b/x", true},
		{"a/**/b", "a/b", true},
		{"a/**/b", "a/x/y/b", true},
		{"a/**/b", "a/x/y/c", false},
		{"a/**", "a/x", true},
		{"*.go", "a/b.go", false},
		{"*", ".dot", true},
		{"a/**/b/**/c", "a/1/b/2/3/c", true},
		{"a/**/b/**/c", "a/1/c", false},
		{"x/*/z", "x/y/z", true},
		{"x/*/z", "x/y/w/z", false},
		{`\*`, "*", true},
		{`\*`, "a", false},
		{"*.{ts,tsx}", "a.tsx", true},
		{"*.{ts,tsx}", "a.ts", true},
		{"*.{ts,tsx}", "a.js", false},
		{"*.{js,{ts,tsx}}", "a.tsx", true},
		{"a{,b}", "a", true},
		{"a{,b}", "ab", true},
		{"{src,lib}/**/*.py", "lib/x/y.py", true},
		{"{src,lib}/**/*.py", "bin/y.py", false},
		{"{a}", "{a}", true},       // no comma: literal, as in bash and picomatch
		{"{a,b", "{a,b", true},     // unclosed: literal
		{`\{a,b}`, "{a,b}", true},  // escaped: literal
		{"[{]a,b}", "{a,b}", true}, // a brace in a class is a character
	}
	for _, tt := range tests {
		p, err := compilePattern(tt.pattern)
		if err != nil {
			t.Fatal(err)
		}
		st := p.start()
		for s := range strings.SplitSeq(tt.path, "/") {
			st = p.step(st, s)
		}
		if got := p.accepts(st); got != tt.want {
			t.Errorf("%q matches %q = %v, want %v", tt.pattern, tt.path, got, tt.want)
		}
	}
}

func grepLines(res protocol.GrepResult) string {
	var out []string
	for _, m := range res.Matches {
		out = append(out, fmt.Sprintf("%s:%d:%s", strings.TrimPrefix(m.Path, "/workspace/"), m.Line, m.Text))
	}
	return strings.Join(out, "|")
}

func TestGrep(t *testing.T) {
	t.Parallel()
	w, dir := searchTree(t, Options{})
	put(t, dir, "huge.txt", strings.Repeat("TODO huge\n", 10))
	small, err := Open(dir, Options{MaxGrepFileBytes: 50, MaxGrepMatches: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()

	tests := []struct {
		name  string
		w     *Workspace
		args  protocol.GrepArgs
		want  string
		trunc bool
		code  string
	}{
		{name: "literal in a dir", args: protocol.GrepArgs{Pattern: "TODO", Path: "src"},
			want: "src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2|src/sub/z.txt:1:TODO z|src/x.go:2:// TODO: x"},
		{name: "whole workspace with glob", args: protocol.GrepArgs{Pattern: "TODO", Glob: "*.go"},
			want: ".hidden.go:1:TODO hidden|[lit]/q.go:1:TODO bracket dir|a.go:2:// TODO: one|src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2|src/x.go:2:// TODO: x|xlink.go:2:// TODO: x"},
		{name: "path glob", args: protocol.GrepArgs{Pattern: "TODO", Glob: "src/**/*.go"},
			want: "src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2|src/x.go:2:// TODO: x"},
		{name: "ignore case and crlf", args: protocol.GrepArgs{Pattern: "todo", IgnoreCase: true, Path: "b.txt"},
			want: "b.txt:1:todo lower|b.txt:2:TODO crlf"},
		{name: "regex", args: protocol.GrepArgs{Pattern: `^TODO y\d$`, Regex: true},
			want: "src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2"},
		{name: "regex end anchor with crlf", args: protocol.GrepArgs{Pattern: `crlf$`, Regex: true}, want: "b.txt:2:TODO crlf"},
		{name: "literal is not a regex", args: protocol.GrepArgs{Pattern: "x()"}, want: "src/x.go:1:func x() {}|xlink.go:1:func x() {}"},
		{name: "single file", args: protocol.GrepArgs{Pattern: "TODO", Path: "/workspace/src/sub/y.go"},
			want: "src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2"},
		{name: "single file, glob on its name", args: protocol.GrepArgs{Pattern: "TODO", Path: "src/sub/y.go", Glob: "*.txt"}, want: ""},
		{name: "max count", args: protocol.GrepArgs{Pattern: "TODO", Path: "src", MaxCount: 2},
			want: "src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2", trunc: true},
		{name: "max count exactly reached", args: protocol.GrepArgs{Pattern: "TODO y", Path: "src", MaxCount: 2},
			want: "src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2"},
		{name: "cap and big-file skip", w: small, args: protocol.GrepArgs{Pattern: "TODO", MaxCount: 100},
			want: ".hidden.go:1:TODO hidden|[lit]/q.go:1:TODO bracket dir|a.go:2:// TODO: one", trunc: true},
		{name: "no match", args: protocol.GrepArgs{Pattern: "absent"}, want: ""},
		{name: "bad regex", args: protocol.GrepArgs{Pattern: "(", Regex: true}, code: protocol.CodeInvalidArgument},
		{name: "empty pattern", args: protocol.GrepArgs{Pattern: ""}, code: protocol.CodeInvalidArgument},
		{name: "brace glob", args: protocol.GrepArgs{Pattern: "TODO", Glob: "*.{txt,go}", Path: "src"},
			want: "src/sub/y.go:1:TODO y1|src/sub/y.go:3:TODO y2|src/sub/z.txt:1:TODO z|src/x.go:2:// TODO: x"},
		{name: "brace path glob", args: protocol.GrepArgs{Pattern: "TODO", Glob: "src/{sub,nope}/*.{txt,md}"}, want: "src/sub/z.txt:1:TODO z"},
		{name: "bad glob", args: protocol.GrepArgs{Pattern: "x", Glob: "[z"}, code: protocol.CodeInvalidArgument},
		{name: "negative max", args: protocol.GrepArgs{Pattern: "x", MaxCount: -1}, code: protocol.CodeInvalidArgument},
		{name: "missing path", args: protocol.GrepArgs{Pattern: "x", Path: "nope"}, code: protocol.CodeFileNotFound},
		{name: "escaping path", args: protocol.GrepArgs{Pattern: "x", Path: "/etc"}, code: protocol.CodeInvalidPath},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ws := tt.w
			if ws == nil {
				ws = w
			}
			got, err := ws.Grep(t.Context(), tt.args)
			wantCode(t, err, tt.code, dir)
			if tt.code != "" {
				return
			}
			if g := grepLines(got); g != tt.want || got.Truncated != tt.trunc {
				t.Errorf("Grep = %q truncated %v\nwant   %q truncated %v", g, got.Truncated, tt.want, tt.trunc)
			}
		})
	}

	t.Run("long line", func(t *testing.T) {
		put(t, dir, "long/l.txt", "é"+strings.Repeat("x", 3000)+"NEEDLE\n")
		got, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "NEEDLE", Path: "long"})
		wantCode(t, err, "", dir)
		if len(got.Matches) != 1 || len(got.Matches[0].Text) > maxMatchText || !strings.HasPrefix(got.Matches[0].Text, "éxxx") {
			t.Errorf("long line match = %+v", got.Matches)
		}
	})
	t.Run("cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		_, err := w.Grep(ctx, protocol.GrepArgs{Pattern: "TODO"})
		wantCode(t, err, protocol.CodeCancelled, dir)
	})
	t.Run("symlinked dir not walked", func(t *testing.T) {
		got, _ := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "TODO"})
		for _, m := range got.Matches {
			if strings.HasPrefix(m.Path, "/workspace/srclink/") || strings.HasPrefix(m.Path, "/workspace/bin.dat") {
				t.Errorf("unexpected match %+v", m)
			}
		}
	})
}

// TestPatternMatchingBounded: what one glob, or one grep's file filter, spends matching names is
// bounded (MaxMatchWork). A pattern of a thousand stars times 256 brace alternatives took about
// 5 ms per 200-byte name, so 22 minutes of a core over the 250,000 names a walk may read, deaf to
// everything but a cancel the client would not send. Past the bound the search stops with
// truncated, like its other caps; ordinary patterns are far inside it.
func TestPatternMatchingBounded(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxMatchWork: 1 << 24})
	long := strings.Repeat("a", 200)
	for i := range 200 {
		put(t, dir, fmt.Sprintf("d/%s%03d.txt", long, i), "needle\n")
	}
	hostile := strings.Repeat("{a,b}", 8) + strings.Repeat("*a", 1990) + "*b"
	g, err := w.Glob(protocol.GlobArgs{Pattern: "d/" + hostile})
	wantCode(t, err, "", dir)
	if !g.Truncated || len(g.Files) != 0 {
		t.Errorf("glob of a costly pattern: %d files, truncated %v; want none and truncated", len(g.Files), g.Truncated)
	}
	for _, filter := range []string{hostile, "d/" + hostile} {
		r, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "needle", Glob: filter})
		wantCode(t, err, "", dir)
		if !r.Truncated || len(r.Matches) != 0 {
			t.Errorf("grep filtered by a costly pattern: %d matches, truncated %v; want none and truncated", len(r.Matches), r.Truncated)
		}
	}
	// An ordinary pattern over the same names stays far inside the bound.
	g, err = w.Glob(protocol.GlobArgs{Pattern: "**/*.{txt,md}"})
	wantCode(t, err, "", dir)
	if g.Truncated || len(g.Files) != 200 {
		t.Errorf("glob **/*.{txt,md}: %d files, truncated %v", len(g.Files), g.Truncated)
	}
	r, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "needle", Glob: "*.txt"})
	wantCode(t, err, "", dir)
	if r.Truncated || len(r.Matches) != 200 {
		t.Errorf("grep --glob *.txt: %d matches, truncated %v", len(r.Matches), r.Truncated)
	}
}

// TestGrepTimeBounded: a grep stops, truncated, once it has matched for MaxGrepTime, checking the
// clock as its work grows, within a long line too. A regular expression's cost per byte grows with
// its size in Go's RE2 (no DFA): "[a-z]{1000}x" took 10 s per MiB of "a", and a grep may read
// 256 MiB, an 8 MiB file of one line included, for one request of a delegate with fs:read.
func TestGrepTimeBounded(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxGrepTime: time.Nanosecond})
	put(t, dir, "lines.txt", strings.Repeat(strings.Repeat("a", 4000)+"\n", 64))
	put(t, dir, "oneline.txt", strings.Repeat("a", 1<<20)+"x\n")
	for _, p := range []string{"lines.txt", "oneline.txt", "/workspace"} {
		r, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "[a-z]{1000}x", Regex: true, Path: p})
		wantCode(t, err, "", dir)
		if !r.Truncated || len(r.Matches) != 0 {
			t.Errorf("grep %s past its time: %d matches, truncated %v; want none and truncated", p, len(r.Matches), r.Truncated)
		}
	}
	// Within the default bound the same long line is searched to its end.
	w, dir = newWS(t, Options{})
	put(t, dir, "oneline.txt", strings.Repeat("a", 64<<10)+"x\n")
	r, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "a{10}x", Regex: true})
	wantCode(t, err, "", dir)
	if r.Truncated || len(r.Matches) != 1 {
		t.Errorf("grep of a long line within the bound: %d matches, truncated %v", len(r.Matches), r.Truncated)
	}
}
