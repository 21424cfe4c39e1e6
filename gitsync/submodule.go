package gitsync

import (
	"bytes"
	"context"
	"crypto/sha1"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/sbxbroker/broker/baseline"
)

// Submodules. A push sends the working tree as the person sees it, and a checked-out submodule is
// part of that: its files (its own tracked files as they are on disk plus its untracked files that
// are not ignored, and the same for the submodules inside it) go into the sandbox under its path.
// To keep one commit the base of diff and pull, the push's snapshot is flattened: each submodule's
// gitlink in the snapshot's tree is replaced by a tree of its files, hashed into this repository's
// object store (git add with this repository's git dir and the submodule's directory as the work
// tree, starting from a copy of the submodule's own index, so that only files changed on disk are
// read). The snapshot is then always a commit made for the push (on top of HEAD, named by no
// branch), whose message lists the gitlinks it replaced (submoduleTrailer): a branch made by pull
// --branch puts them back. A submodule that is not checked out (an empty directory) has nothing
// the person sees: it is left out, and the sandbox has an empty directory or nothing there.
//
// Diff compares with the flattened commit, so it shows the agent's changes inside a submodule
// like any other (paths under the submodule's directory); pull writes them into the submodule's
// working tree, which is its own repository's (unstaged there, as pull leaves every change);
// pull --branch refuses changes inside a submodule, since a branch of this repository cannot hold
// them (a commit records a submodule only as a gitlink).

// submoduleTrailer starts the lines of a flattened snapshot's message that name its submodules:
// "sbctl-submodule: <commit> <path>".
const submoduleTrailer = "sbctl-submodule: "

// gitlink is a submodule's entry of a tree: its path and the commit it names.
type gitlink struct{ Path, Commit string }

// hasSubmodules says whether the work tree at dir may hold submodules (it has a .gitmodules file):
// only then is the snapshot's index searched for gitlinks.
func hasSubmodules(dir string) bool {
	fi, err := os.Lstat(filepath.Join(dir, ".gitmodules"))
	return err == nil && fi.Mode().IsRegular()
}

// gitlinks lists the gitlinks of the index env names, for the work tree at dir.
func gitlinks(ctx context.Context, env []string, dir string) ([]gitlink, error) {
	out, err := run(ctx, dir, env, nil, "ls-files", "-s", "-z")
	if err != nil {
		return nil, err
	}
	var links []gitlink
	for _, rec := range bytes.Split(out, []byte{0}) {
		if !bytes.HasPrefix(rec, []byte("160000 ")) {
			continue
		}
		meta, p, ok := bytes.Cut(rec, []byte("\t"))
		f := strings.Fields(string(meta))
		if !ok || len(f) != 3 {
			return nil, fmt.Errorf("git ls-files answered %q", rec)
		}
		links = append(links, gitlink{Path: string(p), Commit: f[1]})
	}
	return links, nil
}

// checkedOut says whether the submodule directory dir has a repository of its own (.git there,
// a file or a directory): otherwise it was never checked out.
func checkedOut(dir string) bool {
	fi, err := os.Lstat(filepath.Join(dir, ".git"))
	return err == nil && (fi.IsDir() || fi.Mode().IsRegular())
}

// flatten replaces each gitlink of the index env names (for the work tree at dir) by the tree of
// the submodule's files, recursively, and returns the gitlinks it replaced (or removed, for a
// submodule not checked out).
func (r *Repo) flatten(ctx context.Context, env []string, dir string) ([]gitlink, error) {
	links, err := gitlinks(ctx, env, dir)
	if err != nil || len(links) == 0 {
		return nil, err
	}
	for _, l := range links {
		if _, err := run(ctx, dir, env, nil, "update-index", "--force-remove", "--", l.Path); err != nil {
			return nil, err
		}
		sub := filepath.Join(dir, filepath.FromSlash(l.Path))
		if !checkedOut(sub) {
			continue
		}
		tree, err := r.subTree(ctx, sub)
		if err != nil {
			return nil, fmt.Errorf("submodule %s: %w", l.Path, err)
		}
		if _, err := run(ctx, dir, env, nil, "read-tree", "--prefix="+l.Path+"/", tree); err != nil {
			return nil, err
		}
	}
	return links, nil
}

// subTree writes the tree of the submodule work tree at dir (as the person sees it, its own
// submodules flattened too) into this repository's object store. Its index (which only this
// repository's objects may back: the submodule's own index names objects of its own store) is
// kept in this repository's git dir between pushes, so that only files changed on disk are read
// again; one whose objects went (a gc after the refs were deleted) is started afresh.
func (r *Repo) subTree(ctx context.Context, dir string) (string, error) {
	rel, err := filepath.Rel(r.Top, dir)
	if err != nil {
		return "", err
	}
	idx := filepath.Join(r.GitDir, "sbctl", "index-"+fmt.Sprintf("%x", sha1.Sum([]byte(filepath.ToSlash(rel)))))
	if err := os.MkdirAll(filepath.Dir(idx), 0o755); err != nil {
		return "", err
	}
	tree, err := r.subTreeWith(ctx, dir, idx)
	if err != nil {
		os.Remove(idx)
		tree, err = r.subTreeWith(ctx, dir, idx)
	}
	return tree, err
}

func (r *Repo) subTreeWith(ctx context.Context, dir, idx string) (string, error) {
	env := []string{"GIT_INDEX_FILE=" + idx, "GIT_DIR=" + r.GitDir, "GIT_WORK_TREE=" + dir}
	if _, err := run(ctx, dir, env, nil, "add", "-A", "--", "."); err != nil {
		return "", err
	}
	if _, err := r.flatten(ctx, env, dir); err != nil {
		return "", err
	}
	out, err := run(ctx, dir, env, nil, "write-tree")
	return strings.TrimSpace(string(out)), err
}

// trailer is the message lines naming the gitlinks a flattened snapshot replaced.
func trailer(links []gitlink) string {
	var b strings.Builder
	for _, l := range links {
		fmt.Fprintf(&b, "\n%s%s %s", submoduleTrailer, l.Commit, l.Path)
	}
	return b.String()
}

// flattened lists the gitlinks a pushed commit replaced (none for a commit that was not
// flattened).
func (r *Repo) flattened(ctx context.Context, commit string) ([]gitlink, error) {
	out, err := r.git(ctx, nil, nil, "log", "-1", "--format=%B", commit, "--")
	if err != nil {
		return nil, err
	}
	var links []gitlink
	for _, line := range strings.Split(string(out), "\n") {
		rest, ok := strings.CutPrefix(line, submoduleTrailer)
		if !ok {
			continue
		}
		// The message is anyone's (a repository's own commit, pushed unchanged, is the base): only
		// a commit id and a valid path make a gitlink.
		c, p, ok := strings.Cut(rest, " ")
		if ok && isOID(c) && baseline.ValidPath(p) == nil {
			links = append(links, gitlink{Path: p, Commit: c})
		}
	}
	return links, nil
}

// isOID says whether s is a full object id (SHA-1 or SHA-256, lower-case hex).
func isOID(s string) bool {
	if len(s) != 40 && len(s) != 64 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// headTree lists HEAD's files the way a push's snapshot has them: a checked-out submodule's
// gitlink stands for the files of the submodule's own HEAD, under its path (recursively).
func (r *Repo) headTree(ctx context.Context) (map[string]TreeEntry, error) {
	m := map[string]TreeEntry{}
	return m, r.addHeadTree(ctx, r.Top, "", m)
}

func (r *Repo) addHeadTree(ctx context.Context, dir, prefix string, m map[string]TreeEntry) error {
	head, err := run(ctx, dir, nil, nil, "rev-parse", "-q", "--verify", "HEAD^{commit}")
	if err != nil {
		return nil // no commits yet: nothing committed here
	}
	sub := &Repo{Top: dir}
	es, subs, err := sub.Tree(ctx, strings.TrimSpace(string(head)))
	if err != nil {
		return err
	}
	for _, e := range es {
		e.Path = prefix + e.Path
		m[e.Path] = e
	}
	for _, s := range subs {
		d := filepath.Join(dir, filepath.FromSlash(s))
		if checkedOut(d) {
			if err := r.addHeadTree(ctx, d, prefix+s+"/", m); err != nil {
				return err
			}
		}
	}
	return nil
}

// under returns the gitlink whose directory holds p, if any.
func under(p string, links []gitlink) (gitlink, bool) {
	for _, l := range links {
		if p == l.Path || strings.HasPrefix(p, l.Path+"/") {
			return l, true
		}
	}
	return gitlink{}, false
}
