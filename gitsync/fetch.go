package gitsync

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sync/errgroup"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/baseline"
	"github.com/sbxbroker/broker/protocol"
)

// Fetched is what changed in the sandbox, in the local repository's terms: the pushed base commit
// and the changed paths with their blobs (in the object store).
type Fetched struct {
	Base    string // the pushed commit
	Changes []Change
	// Ignored are paths the sandbox added that the repository's ignore rules leave out.
	Ignored int
	// Skipped are sandbox names no git path can be (quoted), left out.
	Skipped []string
}

// Change is one path that differs from the base; New is "" (with Mode "") when it was deleted.
type Change struct {
	Path string
	Mode string
	New  string // blob id
}

// fetchAllOver is the number of changed files above which one tar of the whole workspace is
// cheaper than one tar round trip per file.
const fetchAllOver = 256

// Fetch asks the sandbox what changed since the push (the changes operation: fs:read only), leaves
// out added paths the repository ignores, copies the changed files' contents into the local object
// store; the pushed base commit must be in this repository.
func Fetch(ctx context.Context, dp *backend.Remote, repo *Repo) (*Fetched, error) {
	tr := newTracer()
	ch, err := dp.Changes(ctx, protocol.ChangesArgs{Path: Workspace})
	if err != nil {
		return nil, err
	}
	tr.mark("sandbox changes")
	defer tr.mark("fetch the files")
	// Whether the base is here is asked while the files come (a spawn, against a confusing git
	// error later).
	hasBase := make(chan bool, 1)
	go func() { hasBase <- repo.HasCommit(ctx, ch.Commit) }()
	f, err := fetchChanges(ctx, dp, repo, ch, tr)
	if !<-hasBase {
		return nil, fmt.Errorf("the sandbox was pushed from another repository: its base commit %s is not in %s; run this in the repository you pushed from (or fetch that commit)", short(ch.Commit), repo.Top)
	}
	return f, err
}

func fetchChanges(ctx context.Context, dp *backend.Remote, repo *Repo, ch protocol.ChangesResult, tr *tracer) (*Fetched, error) {
	f := &Fetched{Base: ch.Commit, Skipped: ch.Skipped}
	var added []string
	for _, c := range ch.Changes {
		if err := baseline.ValidPath(c.Path); err != nil {
			return nil, fmt.Errorf("the sandbox reported a change at %q, which is not a valid path (%v)", c.Path, err)
		}
		if c.Status == protocol.ChangeAdded {
			added = append(added, c.Path)
		}
	}
	ignored, err := repo.ignored(ctx, added)
	if err != nil {
		return nil, err
	}
	var want []protocol.Change
	for _, c := range ch.Changes {
		if c.Status == protocol.ChangeAdded && ignored[c.Path] {
			f.Ignored++
			continue
		}
		if c.Status == protocol.ChangeDeleted {
			f.Changes = append(f.Changes, Change{Path: c.Path})
			continue
		}
		want = append(want, c)
	}
	tr.mark("ignore rules")
	got, err := fetchBlobs(ctx, dp, repo, want)
	if err != nil {
		return nil, err
	}
	f.Changes = append(f.Changes, got...)
	slices.SortFunc(f.Changes, func(a, b Change) int { return strings.Compare(a.Path, b.Path) })
	return f, nil
}

func short(oid string) string { return oid[:min(len(oid), 12)] }

// ignored returns which of paths the repository's ignore rules (.gitignore files, info/exclude,
// core.excludesFile) leave out.
func (r *Repo) ignored(ctx context.Context, paths []string) (map[string]bool, error) {
	m := map[string]bool{}
	if len(paths) == 0 {
		return m, nil
	}
	var in bytes.Buffer
	for _, p := range paths {
		in.WriteString(p)
		in.WriteByte(0)
	}
	out, err := r.git(ctx, nil, &in, "check-ignore", "--no-index", "-z", "--stdin")
	var ge *gitError
	if err != nil && !(errors.As(err, &ge) && strings.TrimSpace(ge.stderr) == "") { // exit 1: none ignored
		return nil, err
	}
	for _, p := range bytes.Split(out, []byte{0}) {
		if len(p) > 0 {
			m[string(p)] = true
		}
	}
	return m, nil
}

// fetchBlobs copies the changed files and symlinks into the object store and returns them with
// their blob ids as written (what the sandbox holds now).
func fetchBlobs(ctx context.Context, dp *backend.Remote, repo *Repo, want []protocol.Change) ([]Change, error) {
	if len(want) == 0 {
		return nil, nil
	}
	tmp, err := os.MkdirTemp("", "sbctl-fetch-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	// Each wanted path becomes tmp/N (a symlink's target as a file's content), hashed at the end.
	idx := make(map[string]int, len(want))
	for i, c := range want {
		idx[c.Path] = i
	}
	modes := make([]string, len(want))
	var mu sync.Mutex
	take := func(name string, hdr *tar.Header, r io.Reader) error {
		mu.Lock()
		i, ok := idx[name]
		mu.Unlock()
		if !ok {
			return nil
		}
		var data io.Reader = r
		switch hdr.Typeflag {
		case tar.TypeSymlink:
			modes[i], data = baseline.ModeSymlink, strings.NewReader(hdr.Linkname)
		case tar.TypeReg:
			modes[i] = baseline.ModeFile
			if hdr.Mode&0o100 != 0 {
				modes[i] = baseline.ModeExec
			}
		default:
			return nil
		}
		out, err := os.Create(filepath.Join(tmp, fmt.Sprint(i)))
		if err != nil {
			return err
		}
		_, err = io.Copy(out, data)
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		return err
	}
	if len(want) > fetchAllOver {
		if err := tarEach(ctx, dp, Workspace, func(name string, hdr *tar.Header, r io.Reader) error {
			_, rest, _ := strings.Cut(name, "/") // names start at the workspace's base name
			return take(rest, hdr, r)
		}); err != nil {
			return nil, err
		}
	} else {
		// Not errgroup.WithContext: a failed file does not stop the others, as before; the first
		// error is the one returned.
		var g errgroup.Group
		g.SetLimit(8)
		for _, c := range want {
			g.Go(func() error {
				err := tarEach(ctx, dp, Workspace+"/"+c.Path, func(name string, hdr *tar.Header, r io.Reader) error {
					if name != path.Base(c.Path) {
						return nil
					}
					return take(c.Path, hdr, r)
				})
				var pe *protocol.Error
				if err != nil && !(errors.As(err, &pe) && pe.Code == protocol.CodeFileNotFound) {
					return fmt.Errorf("fetching %s: %w", c.Path, err)
				}
				return nil
			})
		}
		if err := g.Wait(); err != nil {
			return nil, err
		}
	}
	// Hash what arrived into the object store; what vanished meanwhile counts as deleted.
	var in bytes.Buffer
	var order []int
	for i := range want {
		if modes[i] == "" {
			continue
		}
		order = append(order, i)
		in.WriteString(filepath.Join(tmp, fmt.Sprint(i)))
		in.WriteByte('\n')
	}
	var oids []string
	if len(order) > 0 {
		out, err := repo.git(ctx, nil, &in, "hash-object", "-w", "--no-filters", "--stdin-paths")
		if err != nil {
			return nil, err
		}
		oids = strings.Fields(string(out))
		if len(oids) != len(order) {
			return nil, fmt.Errorf("git hash-object returned %d ids for %d files", len(oids), len(order))
		}
	}
	var res []Change
	k := 0
	for i, c := range want {
		if modes[i] == "" {
			res = append(res, Change{Path: c.Path})
			continue
		}
		res = append(res, Change{Path: c.Path, Mode: modes[i], New: oids[k]})
		k++
	}
	return res, nil
}

// tarEach streams the sandbox path p as a tar and calls fn for each entry.
func tarEach(ctx context.Context, dp *backend.Remote, p string, fn func(name string, hdr *tar.Header, r io.Reader) error) error {
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		tr := tar.NewReader(pr)
		var err error
		for {
			var hdr *tar.Header
			hdr, err = tr.Next()
			if err == io.EOF {
				err = nil
				break
			}
			if err != nil {
				break
			}
			name := strings.TrimSuffix(hdr.Name, "/")
			if err = fn(name, hdr, tr); err != nil {
				break
			}
		}
		if err == nil {
			_, err = io.Copy(io.Discard, pr)
		}
		pr.CloseWithError(cmpErr(err, errors.New("the fetch ended")))
		done <- err
	}()
	_, err := dp.Tar(ctx, p, pw)
	pw.CloseWithError(cmpErr(err, io.EOF))
	lerr := <-done
	if err != nil {
		return err
	}
	return lerr
}

func cmpErr(err, otherwise error) error {
	if err != nil {
		return err
	}
	return otherwise
}

// sandboxIndex writes a temporary index holding the sandbox's tree (base with the changes
// applied); the caller removes it.
func (r *Repo) sandboxIndex(ctx context.Context, f *Fetched) (string, error) {
	tmp, err := os.CreateTemp("", "sbctl-index-")
	if err != nil {
		return "", err
	}
	tmp.Close()
	os.Remove(tmp.Name())
	env := []string{"GIT_INDEX_FILE=" + tmp.Name()}
	if _, err := r.git(ctx, env, nil, "read-tree", f.Base); err != nil {
		os.Remove(tmp.Name())
		return "", err
	}
	// Removals first, so that a file may take a removed directory's name and the other way round.
	var in bytes.Buffer
	const zero = "0000000000000000000000000000000000000000"
	for _, c := range f.Changes {
		fmt.Fprintf(&in, "0 %s\t%s\x00", zero, c.Path)
	}
	for _, c := range f.Changes {
		if c.New != "" {
			fmt.Fprintf(&in, "%s %s\t%s\x00", c.Mode, c.New, c.Path)
		}
	}
	if len(f.Changes) > 0 {
		if _, err := r.git(ctx, env, &in, "update-index", "-z", "--index-info"); err != nil {
			os.Remove(tmp.Name())
			return "", err
		}
	}
	return tmp.Name(), nil
}

// SandboxTree writes the sandbox's tree (base with the changes applied) to the object store, with
// the files under each of links (the submodules a flattened push replaced) put back as the gitlink.
func (r *Repo) SandboxTree(ctx context.Context, f *Fetched, links ...gitlink) (string, error) {
	idx, err := r.sandboxIndex(ctx, f)
	if err != nil {
		return "", err
	}
	defer os.Remove(idx)
	// A path is a path, never pathspec magic (":(glob)**" would take every file out).
	env := []string{"GIT_INDEX_FILE=" + idx, "GIT_LITERAL_PATHSPECS=1"}
	for _, l := range links {
		if _, err := r.git(ctx, env, nil, "rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", l.Path); err != nil {
			return "", err
		}
		if _, err := r.git(ctx, env, nil, "update-index", "--add", "--cacheinfo", "160000,"+l.Commit+","+l.Path); err != nil {
			return "", err
		}
	}
	out, err := r.git(ctx, env, nil, "write-tree")
	return strings.TrimSpace(string(out)), err
}

// Diff writes the patch from the base to the sandbox's tree (binary-safe, renames found), or with
// format "stat" or "name-only" git's summary of it.
func (r *Repo) Diff(ctx context.Context, f *Fetched, format string, color bool, w io.Writer) error {
	args := []string{"-c", "core.quotepath=off", "diff", "-M"}
	switch format {
	case "stat":
		args = append(args, "--stat")
	case "name-only":
		args = append(args, "--name-only")
	default:
		args = append(args, "--binary", "--full-index")
	}
	if color {
		args = append(args, "--color=always")
	} else {
		args = append(args, "--no-color")
	}
	idx, err := r.sandboxIndex(ctx, f)
	if err != nil {
		return err
	}
	defer os.Remove(idx)
	args = append(args, "--no-ext-diff", "--no-textconv", "--cached", f.Base, "--")
	out, err := r.git(ctx, []string{"GIT_INDEX_FILE=" + idx}, nil, args...)
	if err != nil {
		return err
	}
	_, err = w.Write(out)
	return err
}
