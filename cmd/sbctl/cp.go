package main

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tartree"
)

func cpCmd(g *globals) *cobra.Command {
	cmd := outputs(&cobra.Command{
		Use:   "cp SRC... DST",
		Short: "Copy files and directories into or out of a sandbox (a sandbox side is REF:PATH)",
		Long: `Copy files and directory trees between this machine and a sandbox, in one round trip each way: a
tar stream over the sandbox's dataplane, extracted by the broker through its traversal-safe file
layer. Modes and mtimes are kept; symbolic links are copied as links and never followed out of the
workspace (nor, on this side, out of the destination directory). FIFOs, sockets and devices are
skipped.

The sandbox side is written REF:PATH, PATH relative to /workspace or absolute under it; write a
local path with a colon as ./a:b. As with cp -r: when DST is an existing directory (or several
sources are given, or DST ends with /), each source lands inside it under its own name; otherwise
the one source is copied as DST. A sandbox DST that is a symbolic link is followed, as cp follows
one: into the directory it names, or through it onto the file (a link leading out of /workspace, or
to nothing, is refused).

"-" reads a tar stream from standard input (into the directory REF:PATH), or writes one to standard
output (of REF:PATH, its entries named from PATH's base name).

Hostile archives (absolute or ".." names, a symlink and then a file through it, hard links leaving
the tree, device nodes, FIFOs, huge headers, control characters in names) are refused with an
error; nothing outside the target directory changes. Copying in needs the fs:write scope, copying
out fs:read. On a terminal a progress line (bytes, rate, time) and then a summary go to stderr;
otherwise cp is quiet (-o json prints what moved).`,
		Example: `  sbctl cp ./src dev:/workspace/          # ./src becomes /workspace/src
  sbctl cp main.go go.mod dev:app          # both into /workspace/app
  sbctl cp dev:/workspace/out ./results     # the sandbox's out/ as ./results
  tar c -C proj . | sbctl cp - dev:proj     # a tar stream from stdin into /workspace/proj
  sbctl cp dev:/workspace/logs - | tar t    # a tar stream of logs/ to stdout`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 2 {
				return usage.Errorf("cp takes at least a source and a destination; see sbctl cp --help")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			srcs, dst := args[:len(args)-1], args[len(args)-1]
			dref, dpath, dremote := sandboxSide(dst)
			nremote := 0
			for _, s := range srcs {
				if _, _, r := sandboxSide(s); r {
					nremote++
				}
			}
			switch {
			case dremote && nremote > 0:
				return usage.Errorf("cp copies between this machine and one sandbox: copy from a sandbox to a local directory first")
			case !dremote && nremote == 0:
				return usage.Errorf("neither side is a sandbox: write the sandbox side as REF:PATH (e.g. dev:/workspace/src)")
			case !dremote && len(srcs) > 1:
				return usage.Errorf("copy out of a sandbox one REF:PATH at a time")
			}
			for _, a := range args {
				if _, p, remote := sandboxSide(a); remote {
					if err := checkSandboxPath(a, p); err != nil {
						return err
					}
				}
			}
			start := time.Now()
			ctx := cmd.Context()
			var res protocol.TreeResult
			var err error
			if dremote {
				res, err = g.cpIn(ctx, srcs, dref, dpath)
			} else {
				ref, p, _ := sandboxSide(srcs[0])
				res, err = g.cpOut(ctx, ref, p, dst)
			}
			if err != nil {
				return err
			}
			if g.output == "json" && dst != "-" {
				return g.print(res, nil)
			}
			if f, ok := g.stderr.(*os.File); ok && isTerminal(f) && !g.quiet {
				g.status("%s\n", summary(res, time.Since(start)))
			}
			return nil
		},
	}, "it prints what moved as JSON, or nothing", "table", "json")
	return cmd
}

// progress is the transfer line on a terminal: bytes of the tar stream so far and the rate,
// rewritten in place a few times a second. A nil *progress counts nothing and prints nothing.
type progress struct {
	g     *globals
	verb  string
	n     atomic.Int64
	start time.Time
	stop  chan struct{}
	done  chan struct{}
}

// startProgress starts the line when stderr is a terminal (and not --quiet), else returns nil.
func (g *globals) startProgress(verb string) *progress {
	f, ok := g.stderr.(*os.File)
	if !ok || !isTerminal(f) || g.quiet {
		return nil
	}
	p := &progress{g: g, verb: verb, start: time.Now(), stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
				n, d := p.n.Load(), time.Since(p.start)
				p.g.status("%s %s, %s/s, %s", p.verb, sizeIEC(n), sizeIEC(int64(float64(n)/d.Seconds())), d.Round(time.Second))
			}
		}
	}()
	return p
}

func (p *progress) add(n int) {
	if p != nil {
		p.n.Add(int64(n))
	}
}

// end stops the line and clears it.
func (p *progress) end() {
	if p == nil {
		return
	}
	close(p.stop)
	<-p.done
	fmt.Fprint(p.g.stderr, "\r\033[K")
}

type progressReader struct {
	r io.Reader
	p *progress
}

func (r progressReader) Read(b []byte) (int, error) {
	n, err := r.r.Read(b)
	r.p.add(n)
	return n, err
}

type progressWriter struct {
	w io.Writer
	p *progress
}

func (w progressWriter) Write(b []byte) (int, error) {
	n, err := w.w.Write(b)
	w.p.add(n)
	return n, err
}

// sandboxSide splits REF:PATH. A local path never looks like one: "-", or a colon after a slash
// (./a:b), or nothing before the colon.
func sandboxSide(arg string) (ref, p string, ok bool) {
	ref, p, ok = strings.Cut(arg, ":")
	if !ok || ref == "" || strings.Contains(ref, "/") || ref == "." || ref == ".." {
		return "", "", false
	}
	if p == "" {
		p = "/workspace"
	}
	return ref, p, true
}

func summary(res protocol.TreeResult, d time.Duration) string {
	rate := ""
	if s := d.Seconds(); s > 0 {
		rate = fmt.Sprintf(", %s/s", sizeIEC(int64(float64(res.Bytes)/s)))
	}
	return fmt.Sprintf("%s, %s, %s, %s in %s%s", count(res.Files, "file", "files"), count(res.Dirs, "dir", "dirs"),
		count(res.Symlinks, "symlink", "symlinks"), sizeIEC(res.Bytes), d.Round(time.Millisecond), rate)
}

// count is n and the noun that goes with it: "1 file", "2 files".
func count[N int | int64](n N, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

func sizeIEC(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// dial opens the dataplane of REF's own broker with the owner's key.
func (g *globals) dial(ctx context.Context, ref string) (*backend.Remote, error) {
	c, err := g.client()
	if err != nil {
		return nil, err
	}
	dp, err := c.SandboxDataplaneURL(ctx, ref)
	if err != nil {
		return nil, err
	}
	return backend.Dial(ctx, backend.Config{URL: dp, Credential: c.APIKey(), Reconnects: 1})
}

// followLinks stats p in the sandbox, following symbolic links (at most 40, as the kernel does)
// to what they name: it returns the path it ended at and what is there. A link leading out of the
// workspace, or too many of them, is the sandbox's content refusing the copy, not a wrong command
// line: its error is no usage error. name is how the person wrote p, for the errors.
func followLinks(ctx context.Context, r *backend.Remote, name, p string) (string, protocol.FileInfo, error) {
	for range 40 {
		fi, err := r.Stat(ctx, p)
		if err != nil || fi.Type != protocol.FileTypeSymlink {
			return p, fi, err
		}
		next := fi.Target
		if !path.IsAbs(next) {
			next = path.Join(path.Dir(path.Clean(p)), next)
		}
		if _, err := protocol.ResolvePath(next); err != nil {
			return p, fi, fmt.Errorf("%s leads out of the workspace: %s is a symbolic link to %s; copy onto a path inside %s",
				name, p, fi.Target, protocol.WorkspaceRoot)
		}
		p = next
	}
	return p, protocol.FileInfo{}, fmt.Errorf("%s: too many levels of symbolic links", name)
}

// checkSandboxPath refuses, as a wrong command line, a sandbox path that the workspace's path
// rules refuse whatever the sandbox holds (outside /workspace, empty, too long). arg is how the
// person wrote it. The broker applies the same rules; a path that passes them and is still
// refused (a link leading out) is refused by what the sandbox holds, which is no usage error.
func checkSandboxPath(arg, p string) error {
	if _, err := protocol.ResolvePath(p); err != nil {
		return usage.Errorf("%s: %s", arg, describe(err))
	}
	return nil
}

// checkCwd is checkSandboxPath for --cwd ("" is the default, /workspace).
func checkCwd(cwd string) error {
	if cwd == "" {
		return nil
	}
	return checkSandboxPath("--cwd", cwd)
}

// cpIn copies local sources (or a tar stream on stdin) into the sandbox.
func (g *globals) cpIn(ctx context.Context, srcs []string, ref, dst string) (protocol.TreeResult, error) {
	for _, s := range srcs {
		if s == "-" && len(srcs) > 1 {
			return protocol.TreeResult{}, usage.Errorf("\"-\" (a tar stream on stdin) is the only source when it is given")
		}
	}
	// Local sources are checked before anything is sent.
	abs := make([]string, len(srcs))
	if srcs[0] != "-" {
		for i, s := range srcs {
			a, err := filepath.Abs(s)
			if err == nil {
				_, err = os.Lstat(a)
			}
			if err != nil {
				return protocol.TreeResult{}, usage.Errorf("cannot copy %s: %v", s, errors.Unwrap(err))
			}
			abs[i] = a
		}
	}
	r, err := g.dial(ctx, ref)
	if err != nil {
		return protocol.TreeResult{}, err
	}
	defer r.Close()
	prog := g.startProgress("sent")
	defer prog.end()
	if srcs[0] == "-" {
		return r.Untar(ctx, dst, progressReader{g.stdin, prog})
	}
	// Where the sources land: inside dst when it is a directory (or will be one), else as dst.
	// A destination that is a symbolic link is followed, as cp follows one: a link to a directory
	// takes the sources in, and one to a file is written through (the broker refuses a link that
	// leads out of /workspace). Before, the link itself was replaced by the copy.
	given := dst
	dst, fi, err := followLinks(ctx, r, ref+":"+given, dst)
	var pe *protocol.Error
	if dst != given && errors.As(err, &pe) && pe.Code == protocol.CodeFileNotFound {
		return protocol.TreeResult{}, fmt.Errorf("%s:%s is a symbolic link to %s, which does not exist", ref, given, dst)
	}
	// A destination the sandbox holds as a file where a directory is needed is the sandbox's
	// content refusing the copy, not a wrong command line: it exits 1, as a link leading out does.
	dir, as := dst, ""
	switch {
	case err == nil && fi.Type == protocol.FileTypeDir:
	case err == nil || errors.As(err, &pe) && pe.Code == protocol.CodeFileNotFound:
		if len(srcs) > 1 || strings.HasSuffix(given, "/") {
			if err != nil {
				break
			}
			if len(srcs) > 1 {
				return protocol.TreeResult{}, fmt.Errorf("%s:%s is not a directory; several sources go into a directory", ref, given)
			}
			return protocol.TreeResult{}, fmt.Errorf("%s:%s is not a directory (a trailing / names one)", ref, given)
		}
		dir, as = path.Dir(path.Clean(dst)), path.Base(path.Clean(dst))
	case errors.As(err, &pe) && pe.Code == protocol.CodeNotDirectory && strings.HasSuffix(dst, "/"):
		// The broker's stat answers not_directory for "file/"; a file by that name says why here.
		if fi, serr := r.Stat(ctx, strings.TrimRight(dst, "/")); serr == nil && fi.Type != protocol.FileTypeDir {
			return protocol.TreeResult{}, fmt.Errorf("%s:%s is not a directory (a trailing / names one)", ref, given)
		}
		return protocol.TreeResult{}, err
	default:
		return protocol.TreeResult{}, err
	}
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		tw := tar.NewWriter(pw)
		err := func() error {
			for _, a := range abs {
				root, err := os.OpenRoot(filepath.Dir(a))
				if err != nil {
					return err
				}
				name := filepath.Base(a)
				if as != "" {
					name = as
				}
				_, err = tartree.Add(ctx, tw, root, filepath.Base(a), name)
				root.Close()
				if err != nil {
					return localErr(filepath.Dir(a), err)
				}
			}
			return tw.Close()
		}()
		pw.CloseWithError(err)
		done <- err
	}()
	res, err := r.Untar(ctx, dir, progressReader{pr, prog})
	pr.CloseWithError(errors.New("the copy ended"))
	if lerr := <-done; lerr != nil && err == nil {
		err = lerr
	}
	return res, err
}

// cpOut copies a sandbox path (a file, a link or a tree) to a local path, or as a tar stream to
// stdout.
func (g *globals) cpOut(ctx context.Context, ref, src, dst string) (protocol.TreeResult, error) {
	if dst == "-" {
		r, err := g.dial(ctx, ref)
		if err != nil {
			return protocol.TreeResult{}, err
		}
		defer r.Close()
		prog := g.startProgress("received")
		defer prog.end()
		return r.Tar(ctx, src, progressWriter{g.stdout, prog})
	}
	abs, err := filepath.Abs(dst)
	if err != nil {
		return protocol.TreeResult{}, usage.Errorf("%s: %v", dst, err)
	}
	dir, as := abs, ""
	if fi, err := os.Stat(abs); err != nil || !fi.IsDir() {
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return protocol.TreeResult{}, usage.Errorf("%s: %v", dst, errors.Unwrap(err))
		}
		if strings.HasSuffix(dst, "/") {
			if err := os.MkdirAll(abs, 0o755); err != nil {
				return protocol.TreeResult{}, usage.Errorf("%s: %v", dst, errors.Unwrap(err))
			}
		} else {
			dir, as = filepath.Dir(abs), filepath.Base(abs)
		}
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return protocol.TreeResult{}, usage.Errorf("%s: the directory to copy into cannot be opened: %v", dst, errors.Unwrap(err))
	}
	defer root.Close()
	r, err := g.dial(ctx, ref)
	if err != nil {
		return protocol.TreeResult{}, err
	}
	defer r.Close()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		_, err := tartree.Extract(ctx, root, pr, tartree.ExtractOptions{As: as})
		if err == nil {
			_, err = io.Copy(io.Discard, pr)
		}
		pr.CloseWithError(cmpErr(err, errors.New("the local extraction ended")))
		done <- localErr(dir, err)
	}()
	prog := g.startProgress("received")
	res, err := r.Tar(ctx, src, progressWriter{pw, prog})
	prog.end()
	pw.CloseWithError(cmpErr(err, io.EOF))
	lerr := <-done
	if err != nil {
		return res, err // the broker's reason, not the cut stream it left behind
	}
	return res, lerr
}

func cmpErr(err, otherwise error) error {
	if err != nil {
		return err
	}
	return otherwise
}

// localErr names the local file behind a tartree error.
func localErr(dir string, err error) error {
	var ee *tartree.EntryError
	if errors.As(err, &ee) {
		cause := ee.Err
		var pe *fs.PathError
		if errors.As(cause, &pe) {
			cause = pe.Err
		}
		return fmt.Errorf("%s: %v", filepath.Join(dir, ee.Name), cause)
	}
	return err
}
