// Package gitsync moves a local git working tree into a sandbox and the sandbox's changes back: the
// client side of sbctl push, diff and pull. It drives the person's own git binary on their own
// repository (never a sandbox's), and the sandbox through the dataplane (backend.Remote): untar and
// upload to push, the changes operation and tar to fetch. What a push sent is recorded in the
// sandbox (package baseline) and, as a commit, in the local repository under refs/sbctl/, so that
// diff and pull compare the sandbox with exactly what was pushed.
//
// It never writes the person's index or HEAD: snapshots use a temporary index, pull writes files of
// the working tree only, and a branch is made with update-ref.
package gitsync

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/sbxbroker/broker/baseline"
)

// Repo is a local git repository with a working tree.
type Repo struct {
	Top    string // the working tree's top level
	GitDir string
}

// Open finds the repository dir belongs to.
func Open(ctx context.Context, dir string) (*Repo, error) {
	if _, err := exec.LookPath("git"); err != nil {
		return nil, errors.New("git is not installed on this machine: push, diff and pull drive your git; install it (e.g. apt-get install git)")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(abs); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a directory", dir)
	}
	out, err := run(ctx, abs, nil, nil, "rev-parse", "--show-toplevel", "--absolute-git-dir")
	if err != nil {
		return nil, fmt.Errorf("%s is not inside a git working tree (push sends a repository's files; copy a plain directory with sbctl cp, or run git init first)", dir)
	}
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) != 2 {
		return nil, fmt.Errorf("git rev-parse answered %q", out)
	}
	return &Repo{Top: lines[0], GitDir: lines[1]}, nil
}

// gitError is a git command that failed: its arguments and what it said.
type gitError struct {
	args   []string
	stderr string
	err    error
}

func (e *gitError) Error() string {
	msg := strings.TrimSpace(e.stderr)
	if msg == "" {
		msg = e.err.Error()
	}
	return fmt.Sprintf("git %s: %s", strings.Join(e.args, " "), msg)
}

func (e *gitError) Unwrap() error { return e.err }

// run runs git in dir with extra environment and stdin, and returns its stdout.
func run(ctx context.Context, dir string, env []string, stdin io.Reader, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = stdin
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.Bytes(), &gitError{args: args, stderr: errb.String(), err: err}
	}
	return out.Bytes(), nil
}

func (r *Repo) git(ctx context.Context, env []string, stdin io.Reader, args ...string) ([]byte, error) {
	return run(ctx, r.Top, env, stdin, args...)
}

func (r *Repo) line(ctx context.Context, args ...string) (string, error) {
	out, err := r.git(ctx, nil, nil, args...)
	return strings.TrimSpace(string(out)), err
}

// Head is HEAD's commit, or "" in a repository without commits.
func (r *Repo) Head(ctx context.Context) string {
	h, err := r.line(ctx, "rev-parse", "-q", "--verify", "HEAD^{commit}")
	if err != nil {
		return ""
	}
	return h
}

// HasCommit says whether the commit is in this repository.
func (r *Repo) HasCommit(ctx context.Context, c string) bool {
	_, err := r.git(ctx, nil, nil, "cat-file", "-e", c+"^{commit}")
	return err == nil
}

// commitTree runs git commit-tree as the person, or as "sbctl" in a repository where git knows no
// identity (no user.name or user.email).
func (r *Repo) commitTree(ctx context.Context, args []string) ([]byte, error) {
	out, err := r.git(ctx, nil, nil, args...)
	if err == nil {
		return out, nil
	}
	if _, verr := r.git(ctx, nil, nil, "var", "GIT_COMMITTER_IDENT"); verr == nil {
		if _, verr := r.git(ctx, nil, nil, "var", "GIT_AUTHOR_IDENT"); verr == nil {
			return out, err
		}
	}
	return r.git(ctx, []string{"GIT_AUTHOR_NAME=sbctl", "GIT_AUTHOR_EMAIL=sbctl@localhost", "GIT_COMMITTER_NAME=sbctl", "GIT_COMMITTER_EMAIL=sbctl@localhost"}, nil, args...)
}

// Snapshot is what a push sends: a commit and its tree.
type Snapshot struct {
	Commit string
	Tree   string
	// Synthetic is set when Commit was made for the push: the working tree differed from HEAD.
	Synthetic bool
}

// Snap takes the snapshot of rev (a commit), or with rev "" of the working tree as the person sees
// it: tracked files as they are on disk plus untracked files that are not ignored. The working
// tree's snapshot goes through a temporary index, so the person's index is untouched; when it
// differs from HEAD it becomes a commit on top of HEAD (written to the object store, named by no
// branch).
//
// prev, when set, names the commit the last push made (a ref): a working tree that has not
// changed since is that commit again, not a new one.
func (r *Repo) Snap(ctx context.Context, rev, prev string) (Snapshot, error) {
	if rev != "" {
		c, err := r.line(ctx, "rev-parse", "-q", "--verify", rev+"^{commit}")
		if err != nil {
			return Snapshot{}, fmt.Errorf("--rev %s names no commit of %s", rev, r.Top)
		}
		t, err := r.line(ctx, "rev-parse", c+"^{tree}")
		return Snapshot{Commit: c, Tree: t}, err
	}
	tmp, err := os.CreateTemp("", "sbctl-index-")
	if err != nil {
		return Snapshot{}, err
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	// A copy of the index keeps git's stat cache: only files changed on disk are read again.
	if b, err := os.ReadFile(filepath.Join(r.GitDir, "index")); err == nil {
		if err := os.WriteFile(tmp.Name(), b, 0o600); err != nil {
			return Snapshot{}, err
		}
	} else {
		os.Remove(tmp.Name())
	}
	env := []string{"GIT_INDEX_FILE=" + tmp.Name()}
	// HEAD and the last push's commit are looked up while git add reads the working tree.
	var headOut, prevOut []byte
	var headErr, prevErr error
	looked := make(chan struct{})
	go func() {
		defer close(looked)
		headOut, headErr = r.git(ctx, nil, nil, "rev-parse", "HEAD^{commit}", "HEAD^{tree}")
		if prev != "" {
			prevOut, prevErr = r.git(ctx, nil, nil, "log", "-1", "--format=%H %T %P", prev, "--")
		} else {
			prevErr = errors.New("no previous push")
		}
	}()
	_, err = r.git(ctx, env, nil, "add", "-A", "--", ".")
	<-looked
	if err != nil {
		return Snapshot{}, err
	}
	var links []gitlink
	if hasSubmodules(r.Top) {
		// Their files go too, as the person sees them (submodule.go).
		if links, err = r.flatten(ctx, env, r.Top); err != nil {
			return Snapshot{}, err
		}
	}
	out, err := r.git(ctx, env, nil, "write-tree")
	if err != nil {
		return Snapshot{}, err
	}
	tree := strings.TrimSpace(string(out))
	head := ""
	if headErr == nil {
		f := strings.Fields(string(headOut))
		if len(f) == 2 && f[1] == tree {
			return Snapshot{Commit: f[0], Tree: tree}, nil
		}
		if len(f) == 2 {
			head = f[0]
		}
	}
	if prevErr == nil {
		if f := strings.Fields(string(prevOut)); len(f) >= 2 && f[1] == tree && ((head == "" && len(f) == 2) || (len(f) == 3 && f[2] == head)) {
			return Snapshot{Commit: f[0], Tree: tree, Synthetic: true}, nil
		}
	}
	args := []string{"commit-tree", tree, "-m", "sbctl push: the working tree at " + time.Now().UTC().Format(time.RFC3339) + "\n" + trailer(links)}
	if head != "" {
		args = append(args, "-p", head)
	}
	out, err = r.commitTree(ctx, args)
	if err != nil {
		return Snapshot{}, err
	}
	return Snapshot{Commit: strings.TrimSpace(string(out)), Tree: tree, Synthetic: true}, nil
}

// TreeEntry is one file or symlink of a tree.
type TreeEntry struct {
	Mode, OID, Path string
}

// Tree lists the files and symlinks of a tree (or commit) recursively, sorted by path. Submodules
// (gitlinks) are returned apart: a working tree's snapshot has none left (Snap flattens them), a
// commit's (push --rev) are left out.
func (r *Repo) Tree(ctx context.Context, treeish string) (entries []TreeEntry, submodules []string, err error) {
	out, err := r.git(ctx, nil, nil, "ls-tree", "-r", "-z", "--full-tree", treeish)
	if err != nil {
		return nil, nil, err
	}
	for _, rec := range bytes.Split(out, []byte{0}) {
		if len(rec) == 0 {
			continue
		}
		meta, p, ok := bytes.Cut(rec, []byte("\t"))
		f := strings.Fields(string(meta))
		if !ok || len(f) != 3 {
			return nil, nil, fmt.Errorf("git ls-tree answered %q", rec)
		}
		if f[1] == "commit" {
			submodules = append(submodules, string(p))
			continue
		}
		entries = append(entries, TreeEntry{Mode: f[0], OID: f[2], Path: string(p)})
	}
	return entries, submodules, nil
}

// treeMap indexes a tree's entries by path.
func (r *Repo) treeMap(ctx context.Context, treeish string) (map[string]TreeEntry, error) {
	if treeish == "" {
		return map[string]TreeEntry{}, nil
	}
	es, _, err := r.Tree(ctx, treeish)
	if err != nil {
		return nil, err
	}
	m := make(map[string]TreeEntry, len(es))
	for _, e := range es {
		m[e.Path] = e
	}
	return m, nil
}

// SetRef points ref at commit, so that the object store keeps it.
func (r *Repo) SetRef(ctx context.Context, ref, commit string) error {
	_, err := r.git(ctx, nil, nil, "update-ref", ref, commit)
	return err
}

// blobs streams objects out of the repository (git cat-file --batch).
type blobs struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

func (r *Repo) openBlobs(ctx context.Context) (*blobs, error) {
	cmd := exec.CommandContext(ctx, "git", "cat-file", "--batch")
	cmd.Dir = r.Top
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &blobs{cmd: cmd, in: in, out: bufio.NewReaderSize(out, 256<<10)}, nil
}

// open asks for oid and returns its size; the caller reads exactly that many bytes from b.out and
// then calls done.
func (b *blobs) open(oid string) (int64, error) {
	if _, err := fmt.Fprintln(b.in, oid); err != nil {
		return 0, err
	}
	hdr, err := b.out.ReadString('\n')
	if err != nil {
		return 0, fmt.Errorf("git cat-file: %w", err)
	}
	f := strings.Fields(hdr)
	if len(f) != 3 || f[1] != "blob" {
		return 0, fmt.Errorf("git cat-file: object %s is missing or not a blob (%q)", oid, strings.TrimSpace(hdr))
	}
	var n int64
	_, err = fmt.Sscan(f[2], &n)
	return n, err
}

func (b *blobs) done() error {
	_, err := b.out.Discard(1) // the newline after the content
	return err
}

func (b *blobs) read(oid string) ([]byte, error) {
	n, err := b.open(oid)
	if err != nil {
		return nil, err
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(b.out, buf); err != nil {
		return nil, err
	}
	return buf, b.done()
}

// readMax reads a blob of at most max bytes; nil (and the blob skipped) when it is larger.
func (b *blobs) readMax(oid string, max int64) ([]byte, error) {
	n, err := b.open(oid)
	if err != nil {
		return nil, err
	}
	if n > max {
		if _, err := b.out.Discard(int(n)); err != nil {
			return nil, err
		}
		return nil, b.done()
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(b.out, buf); err != nil {
		return nil, err
	}
	return buf, b.done()
}

func (b *blobs) close() {
	b.in.Close()
	b.cmd.Wait()
}

// validPaths refuses a tree with a path that no tar entry or sandbox can hold.
func validPaths(es []TreeEntry) error {
	for _, e := range es {
		if err := baseline.ValidPath(e.Path); err != nil {
			return fmt.Errorf("%q cannot be pushed: %v; rename it or push with --rev a commit without it", e.Path, err)
		}
	}
	return nil
}
