package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/sbxbroker/broker/baseline"
)

// PullResult says what a pull did to the working tree.
type PullResult struct {
	Updated []string `json:"updated"` // written as the sandbox has them
	Deleted []string `json:"deleted"`
	Merged  []string `json:"merged"` // three-way merged without conflicts
	// Conflicts were merged with conflict markers (text) or left as they are here (the rest).
	Conflicts []string `json:"conflicts"`
	Same      int      `json:"same"` // already as the sandbox has them
}

// LocalChangesError is a pull that would touch files changed here since the push and not
// committed.
type LocalChangesError struct{ Paths []string }

func (e *LocalChangesError) Error() string {
	return fmt.Sprintf("%s changed here since the push and not committed, and the sandbox changed %s too: commit or stash first, pull --branch NAME to get the sandbox's work as a branch, or pull --force to merge into %s (conflicts get markers)",
		list(e.Paths), map[bool]string{true: "it", false: "them"}[len(e.Paths) == 1], map[bool]string{true: "it", false: "them"}[len(e.Paths) == 1])
}

// local is what the working tree holds at a path.
type local struct {
	kind string // "", "file", "symlink", "dir", "other"
	mode string
	oid  string
	size int64
}

func (l local) same(mode, oid string) bool {
	if oid == "" {
		return l.kind == "" || l.kind == "dir"
	}
	return (l.kind == "file" || l.kind == "symlink") && l.mode == mode && l.oid == oid
}

// readLocal reads a path of the working tree through root, never following a link.
func readLocal(root *os.Root, p string) (local, error) {
	// A symlink among the parents would make the path lead elsewhere: that is not this path.
	for d := path.Dir(p); d != "."; d = path.Dir(d) {
		fi, err := root.Lstat(d)
		if errors.Is(err, fs.ErrNotExist) {
			return local{}, nil
		}
		if err != nil {
			return local{}, err
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return local{kind: "other"}, nil // the path leads elsewhere: never written through
		}
		if !fi.IsDir() {
			return local{}, nil // a file where a directory would be: nothing at this path
		}
	}
	fi, err := root.Lstat(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return local{}, nil
	case err != nil:
		return local{}, err
	case fi.Mode()&fs.ModeSymlink != 0:
		t, err := root.Readlink(p)
		if err != nil {
			return local{}, err
		}
		return local{kind: "symlink", mode: baseline.ModeSymlink, oid: baseline.BlobID([]byte(t))}, nil
	case fi.IsDir():
		// git has no directories: where the sandbox puts a file, a directory here whose files this
		// pull deletes goes with them (deletes run first).
		return local{kind: "dir"}, nil
	case fi.Mode().IsRegular():
		f, err := root.OpenFile(p, os.O_RDONLY|noFollow, 0)
		if err != nil {
			return local{}, err
		}
		defer f.Close()
		h := baseline.NewHasher()
		h.Start(fi.Size())
		if n, err := io.Copy(h, io.LimitReader(f, fi.Size())); err != nil || n != fi.Size() {
			return local{}, fmt.Errorf("%s changed while it was read; pull again", p)
		}
		m := baseline.ModeFile
		if fi.Mode()&0o100 != 0 {
			m = baseline.ModeExec
		}
		return local{kind: "file", mode: m, oid: h.Sum(), size: fi.Size()}, nil
	}
	return local{kind: "other"}, nil
}

// step is what a pull does at one path.
type step struct {
	c      Change
	action string // "write", "delete", "merge", "keep"
	data   []byte // for a merge: the sandbox's version
	mode   string
}

// maxMerge is the largest file pull merges three ways (each version is held in memory).
const maxMerge = 16 << 20

// Pull applies the sandbox's changes to the working tree. At each changed path: what is here is
// the pushed base's version, so the sandbox's replaces it; or it already is the sandbox's; or it
// changed here too, and then a text file is merged three ways (the base, this tree, the sandbox;
// git merge-file) when it is committed here or force is set, and anything else is refused before a
// file is written (LocalChangesError). With force, what cannot be merged (binary, links, a delete
// against a change) keeps this tree's version and is listed as a conflict. The index and HEAD are
// not touched: the changes show as unstaged.
func Pull(ctx context.Context, repo *Repo, f *Fetched, force bool) (PullResult, error) {
	res := PullResult{Updated: []string{}, Deleted: []string{}, Merged: []string{}, Conflicts: []string{}}
	root, err := os.OpenRoot(repo.Top)
	if err != nil {
		return res, err
	}
	defer root.Close()
	base, err := repo.treeMap(ctx, f.Base)
	if err != nil {
		return res, err
	}
	// HEAD as a snapshot has it: a submodule's files as committed in the submodule.
	head, err := repo.headTree(ctx)
	if err != nil {
		return res, err
	}
	b, err := repo.openBlobs(ctx)
	if err != nil {
		return res, err
	}
	defer b.close()
	var steps []step
	var refused []string
	for _, c := range f.Changes {
		l, err := readLocal(root, c.Path)
		if err != nil {
			return res, fmt.Errorf("%s: %w", c.Path, err)
		}
		be := base[c.Path]
		switch {
		case l.same(c.Mode, c.New):
			res.Same++
			continue
		case l.same(be.Mode, be.OID):
			if c.New == "" {
				steps = append(steps, step{c: c, action: "delete"})
				continue
			}
			steps = append(steps, step{c: c, action: "write", mode: c.Mode})
			continue
		}
		// Changed here and in the sandbox.
		he, inHead := head[c.Path]
		committed := l.same(he.Mode, he.OID) && (inHead || l.kind == "")
		if !committed && !force {
			refused = append(refused, c.Path)
			continue
		}
		if l.kind == "file" && l.size <= maxMerge && c.New != "" && c.Mode != baseline.ModeSymlink && be.OID != "" && be.Mode != baseline.ModeSymlink {
			theirs, err := b.readMax(c.New, maxMerge)
			if err != nil {
				return res, err
			}
			old, err := b.readMax(be.OID, maxMerge)
			if err != nil {
				return res, err
			}
			mine, err := root.ReadFile(c.Path)
			if err != nil {
				return res, err
			}
			if theirs != nil && old != nil && !binary(mine) && !binary(theirs) && !binary(old) {
				mode := l.mode
				if l.mode == be.Mode {
					mode = c.Mode
				}
				steps = append(steps, step{c: c, action: "merge", data: theirs, mode: mode})
				continue
			}
		}
		if !force {
			refused = append(refused, c.Path)
			continue
		}
		steps = append(steps, step{c: c, action: "keep"})
	}
	if len(refused) > 0 {
		return res, &LocalChangesError{Paths: refused}
	}
	// Deletes first: a file may take the name of a directory whose files went.
	slices.SortStableFunc(steps, func(a, b step) int {
		return boolInt(a.action != "delete") - boolInt(b.action != "delete")
	})
	for _, s := range steps {
		p := s.c.Path
		switch s.action {
		case "delete":
			if err := root.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return res, fmt.Errorf("%s: %w", p, err)
			}
			removeEmptyParents(root, p)
			res.Deleted = append(res.Deleted, p)
		case "write":
			n, err := b.open(s.c.New)
			if err != nil {
				return res, err
			}
			err = writeLocal(root, p, s.mode, io.LimitReader(b.out, n))
			if derr := b.done(); err == nil {
				err = derr
			}
			if err != nil {
				return res, err
			}
			res.Updated = append(res.Updated, p)
		case "merge":
			merged, conflicts, err := repo.mergeFile(ctx, root, p, base[p].OID, s.data)
			if err != nil {
				return res, err
			}
			if err := writeLocal(root, p, s.mode, bytes.NewReader(merged)); err != nil {
				return res, err
			}
			if conflicts {
				res.Conflicts = append(res.Conflicts, p)
			} else {
				res.Merged = append(res.Merged, p)
			}
		case "keep":
			res.Conflicts = append(res.Conflicts, p)
		}
	}
	return res, nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func binary(b []byte) bool { return bytes.IndexByte(b[:min(len(b), 8000)], 0) >= 0 }

// mergeFile merges the sandbox's version (theirs) into this tree's file at p against the base
// blob, with git merge-file; conflicts leave markers.
func (r *Repo) mergeFile(ctx context.Context, root *os.Root, p, baseOID string, theirs []byte) ([]byte, bool, error) {
	dir, err := os.MkdirTemp("", "sbctl-merge-")
	if err != nil {
		return nil, false, err
	}
	defer os.RemoveAll(dir)
	mine, err := root.ReadFile(p)
	if err != nil {
		return nil, false, err
	}
	b, err := r.openBlobs(ctx)
	if err != nil {
		return nil, false, err
	}
	old, err := b.read(baseOID)
	b.close()
	if err != nil {
		return nil, false, err
	}
	files := []string{filepath.Join(dir, "mine"), filepath.Join(dir, "base"), filepath.Join(dir, "theirs")}
	for i, data := range [][]byte{mine, old, theirs} {
		if err := os.WriteFile(files[i], data, 0o600); err != nil {
			return nil, false, err
		}
	}
	out, err := r.git(ctx, nil, nil, "merge-file", "-p", "-L", "yours", "-L", "pushed", "-L", "sandbox", files[0], files[1], files[2])
	var ge *gitError
	if errors.As(err, &ge) && strings.TrimSpace(ge.stderr) == "" {
		return out, true, nil // exit status = number of conflicts
	}
	return out, false, err
}

// writeLocal writes a file or symlink at p through root: its parents must be directories (never a
// link), and the file is written beside and renamed over, so a link at p is replaced, not followed.
func writeLocal(root *os.Root, p, mode string, r io.Reader) error {
	if err := baseline.ValidPath(p); err != nil {
		return fmt.Errorf("%q: %v", p, err)
	}
	if d := path.Dir(p); d != "." {
		for dd := d; dd != "."; dd = path.Dir(dd) {
			if fi, err := root.Lstat(dd); err == nil && !fi.IsDir() {
				if fi.Mode()&fs.ModeSymlink != 0 {
					return fmt.Errorf("%s: %s here is a symbolic link; the sandbox's file is not written through it", p, dd)
				}
				return fmt.Errorf("%s: %s here is not a directory", p, dd)
			}
		}
		if err := root.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	}
	tmp := path.Join(path.Dir(p), ".sbctl-pull-"+path.Base(p))
	root.Remove(tmp)
	switch mode {
	case baseline.ModeSymlink:
		target, err := io.ReadAll(io.LimitReader(r, 4097))
		if err != nil || len(target) > 4096 {
			return fmt.Errorf("%s: a symbolic link's target over 4096 bytes", p)
		}
		if err := root.Symlink(string(target), tmp); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	default:
		perm := fs.FileMode(0o644)
		if mode == baseline.ModeExec {
			perm = 0o755
		}
		fh, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		_, err = io.Copy(fh, r)
		if cerr := fh.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = root.Chmod(tmp, perm) // whatever the umask
		}
		if err != nil {
			root.Remove(tmp)
			return fmt.Errorf("%s: %w", p, err)
		}
	}
	if fi, err := root.Lstat(p); err == nil && fi.IsDir() {
		root.Remove(tmp)
		return fmt.Errorf("%s is a directory here; the sandbox has a file there", p)
	}
	if err := root.Rename(tmp, p); err != nil {
		root.Remove(tmp)
		return fmt.Errorf("%s: %w", p, err)
	}
	return nil
}

func removeEmptyParents(root *os.Root, p string) {
	for d := path.Dir(p); d != "."; d = path.Dir(d) {
		if root.Remove(d) != nil {
			return
		}
	}
}

// Why Branch makes no branch, for callers to tell apart (errors.Is).
var (
	ErrBadBranchName  = errors.New("not a valid branch name")
	ErrBranchExists   = errors.New("the branch exists already")
	ErrNothingChanged = errors.New("nothing changed since the push")
)

// branchError says why Branch refused in words, and which of the reasons above it is.
type branchError struct {
	why error
	msg string
}

func (e *branchError) Error() string { return e.msg }
func (e *branchError) Unwrap() error { return e.why }

// Branch commits the sandbox's tree on top of the pushed base as a new local branch and returns
// the commit. An existing branch of that name is an error.
func Branch(ctx context.Context, repo *Repo, f *Fetched, name, sandbox string) (string, error) {
	if _, err := repo.git(ctx, nil, nil, "check-ref-format", "--branch", name); err != nil {
		return "", &branchError{ErrBadBranchName, fmt.Sprintf("%q is not a valid branch name", name)}
	}
	if len(f.Changes) == 0 {
		return "", &branchError{ErrNothingChanged, fmt.Sprintf("nothing changed in sandbox %s since the push of %s: no branch made", sandbox, short(f.Base))}
	}
	if _, err := repo.git(ctx, nil, nil, "rev-parse", "-q", "--verify", "refs/heads/"+name); err == nil {
		return "", &branchError{ErrBranchExists, fmt.Sprintf("branch %s exists already; choose another name (or delete it: git branch -D %s)", name, name)}
	}
	links, err := repo.flattened(ctx, f.Base)
	if err != nil {
		return "", err
	}
	var inSub []string
	for _, c := range f.Changes {
		if l, ok := under(c.Path, links); ok && !slices.Contains(inSub, l.Path) {
			inSub = append(inSub, l.Path)
		}
	}
	if len(inSub) > 0 {
		return "", fmt.Errorf("the sandbox changed files inside submodule %s, and a branch of this repository cannot hold them (a commit records a submodule as a commit of its own repository): run sbctl pull %s without --branch, which writes them into the submodule's working tree, then commit them in the submodule", list(inSub), sandbox)
	}
	tree, err := repo.SandboxTree(ctx, f, links...)
	if err != nil {
		return "", err
	}
	out, err := repo.commitTree(ctx, []string{"commit-tree", tree, "-p", f.Base, "-m", fmt.Sprintf("Changes made in sandbox %s since the push of %s", sandbox, short(f.Base))})
	if err != nil {
		return "", err
	}
	c := strings.TrimSpace(string(out))
	if _, err := repo.git(ctx, nil, nil, "update-ref", "refs/heads/"+name, c, ""); err != nil {
		return "", err
	}
	return c, nil
}
