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
	"slices"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/baseline"
	"github.com/sbxbroker/broker/protocol"
)

// Workspace is the sandbox directory a repository is pushed to.
const Workspace = "/workspace"

// RefPrefix names the local refs that keep each sandbox's pushed base commit.
const RefPrefix = "refs/sbctl/"

// PushOptions tune Push.
type PushOptions struct {
	// Rev pushes exactly this commit instead of the working tree.
	Rev string
	// Force sends every file and records a new baseline even when the sandbox's files changed
	// since the last push or its baseline is damaged.
	Force bool
	// SandboxID names the local ref that keeps the pushed commit (refs/sbctl/ID).
	SandboxID string
	// Wrap, when set, wraps the tar stream on its way out (a progress count).
	Wrap func(io.Reader) io.Reader
}

// PushResult says what a push did.
type PushResult struct {
	Commit    string `json:"commit"`
	Synthetic bool   `json:"synthetic"` // the commit was made for the push from a dirty working tree
	Full      bool   `json:"full"`      // every file was sent (no usable baseline)
	Sent      int    `json:"sent"`
	Deleted   int    `json:"deleted"`
	Unchanged int    `json:"unchanged"`
	Bytes     int64  `json:"bytes"`
	// Submodules were left out: those of a --rev commit (a working tree's are sent, flattened).
	Submodules []string `json:"submodules,omitempty"`
}

// ConflictError is a push that would overwrite what changed in the sandbox since the last push.
type ConflictError struct{ Paths []string }

func (e *ConflictError) Error() string {
	return fmt.Sprintf("the sandbox changed %s since the last push, and this push would overwrite %s: look with sbctl diff, bring the changes here with sbctl pull, or push --force to overwrite them",
		list(e.Paths), map[bool]string{true: "it", false: "them"}[len(e.Paths) == 1])
}

func list(ps []string) string {
	const shown = 5
	q := make([]string, 0, shown)
	for _, p := range ps[:min(len(ps), shown)] {
		q = append(q, fmt.Sprintf("%q", p))
	}
	s := strings.Join(q, ", ")
	if len(ps) > shown {
		s += fmt.Sprintf(" and %d more", len(ps)-shown)
	}
	return s
}

// RecordPath is the sandbox path of the baseline record.
const RecordPath = Workspace + "/" + protocol.BaselineRecord

// readRecord fetches the sandbox's baseline record: ok false when there is none. It reads at most
// baseline.MaxRecordBytes of it: the sandbox may have put a file of any size there, which the
// download would otherwise hold whole in memory (the buffer's refusal cancels the download at the
// broker).
func readRecord(ctx context.Context, dp *backend.Remote) (baseline.Record, bool, error) {
	buf := &cappedBuffer{max: baseline.MaxRecordBytes}
	if _, err := dp.Download(ctx, RecordPath, buf); err != nil {
		var pe *protocol.Error
		switch {
		case errors.Is(err, errRecordTooBig):
			return baseline.Record{}, true, fmt.Errorf("%w (it is over %d MiB)", baseline.ErrDamaged, baseline.MaxRecordBytes>>20)
		case errors.As(err, &pe) && pe.Code == protocol.CodeFileNotFound:
			return baseline.Record{}, false, nil
		case errors.As(err, &pe) && (pe.Code == protocol.CodeInvalidPath || pe.Code == protocol.CodeInvalidArgument):
			// A link leading out, a directory, a FIFO: whatever the sandbox put at its place.
			return baseline.Record{}, true, fmt.Errorf("%w: %s", baseline.ErrDamaged, pe.Message)
		}
		return baseline.Record{}, false, err
	}
	rec, err := baseline.Parse(buf.Bytes())
	if err != nil {
		return baseline.Record{}, true, err
	}
	return rec, true, nil
}

// errRecordTooBig stops a record's download at baseline.MaxRecordBytes.
var errRecordTooBig = errors.New("the baseline record is too big")

// cappedBuffer is a bytes.Buffer that takes at most max bytes, then fails the write.
type cappedBuffer struct {
	bytes.Buffer
	max int
}

func (b *cappedBuffer) Write(p []byte) (int, error) {
	if b.Len()+len(p) > b.max {
		return 0, errRecordTooBig
	}
	return b.Buffer.Write(p)
}

// Push sends the repository's snapshot to the sandbox's workspace: everything the first time,
// then only the files whose blob ids differ from the sandbox's baseline record, and deletes what
// the snapshot no longer has. Files the sandbox changed since the last push are never overwritten
// without opt.Force (a ConflictError). The new baseline record is written last, once the files are
// in place, and the pushed commit is kept locally under refs/sbctl/<sandbox id>.
func Push(ctx context.Context, dp *backend.Remote, repo *Repo, opt PushOptions) (PushResult, error) {
	var res PushResult
	tr := newTracer()
	// The record comes over the network while the snapshot is taken here.
	type recAnswer struct {
		rec   baseline.Record
		found bool
		err   error
	}
	recCh := make(chan recAnswer, 1)
	go func() {
		rec, found, err := readRecord(ctx, dp)
		recCh <- recAnswer{rec, found, err}
	}()
	prev := ""
	if opt.SandboxID != "" {
		prev = RefPrefix + opt.SandboxID
	}
	snap, snapErr := repo.Snap(ctx, opt.Rev, prev)
	var entries []TreeEntry
	var subs []string
	if snapErr == nil {
		tr.mark("snapshot")
		entries, subs, snapErr = repo.Tree(ctx, snap.Tree)
		if snapErr == nil {
			snapErr = validPaths(entries)
		}
		tr.mark("list the tree")
	}
	ra := <-recCh
	if snapErr != nil {
		return res, snapErr
	}
	old, found, err := ra.rec, ra.found, ra.err
	switch {
	case err != nil && errors.Is(err, baseline.ErrDamaged) && opt.Force:
		found = false
		// Whatever is at the record's place goes (a link itself, never its target), so that the
		// new record is a plain file.
		if err := dp.Delete(ctx, protocol.DeleteArgs{Path: RecordPath, Recursive: true}); err != nil {
			return res, fmt.Errorf("removing the damaged baseline: %w", err)
		}
	case err != nil && errors.Is(err, baseline.ErrDamaged):
		return res, fmt.Errorf("%v; push --force sends every file and records a new baseline", err)
	case err != nil:
		return res, err
	}
	if !found {
		old = baseline.Record{}
		res.Full = true
	}
	res.Commit, res.Synthetic, res.Submodules = snap.Commit, snap.Synthetic, subs

	// What to send: entries whose mode or blob differ from the record's.
	now := time.Now().Truncate(time.Second)
	rec := baseline.Record{Commit: snap.Commit, Entries: make([]baseline.Entry, 0, len(entries))}
	var send []TreeEntry
	inNew := make(map[string]bool, len(entries))
	for _, e := range entries {
		inNew[e.Path] = true
		if o, ok := old.Find(e.Path); ok && o.Mode == e.Mode && o.OID == e.OID && !(opt.Force && !found) {
			rec.Entries = append(rec.Entries, o)
			res.Unchanged++
			continue
		}
		send = append(send, e)
	}
	var del []string
	for _, o := range old.Entries {
		if !inNew[o.Path] {
			del = append(del, o.Path)
		}
	}

	// Nothing the sandbox changed may be overwritten or deleted unless told.
	if found && !opt.Force && (len(send) > 0 || len(del) > 0) {
		// Only the paths this push touches matter (the whole tree past a point).
		args := protocol.ChangesArgs{Path: Workspace}
		if len(send)+len(del) <= protocol.MaxChangesPaths {
			for _, e := range send {
				args.Paths = append(args.Paths, e.Path)
			}
			args.Paths = append(args.Paths, del...)
		}
		ch, err := dp.Changes(ctx, args)
		if err != nil {
			return res, err
		}
		changed := make(map[string]protocol.Change, len(ch.Changes))
		for _, c := range ch.Changes {
			changed[c.Path] = c
		}
		var conflicts []string
		for _, e := range send {
			if c, ok := changed[e.Path]; ok && !(c.Mode == e.Mode && c.OID == e.OID) {
				conflicts = append(conflicts, e.Path)
			}
		}
		for _, p := range del {
			if c, ok := changed[p]; ok && c.Status != protocol.ChangeDeleted {
				conflicts = append(conflicts, p)
			}
		}
		if len(conflicts) > 0 {
			slices.Sort(conflicts)
			return res, &ConflictError{Paths: conflicts}
		}
		tr.mark("sandbox changes")
	}

	if err := deleteAll(ctx, dp, del); err != nil {
		return res, err
	}
	for _, d := range emptied(del, entries) {
		// Not empty (the sandbox put something there) is fine: the directory stays.
		dp.Delete(ctx, protocol.DeleteArgs{Path: Workspace + "/" + d})
	}
	res.Deleted = len(del)

	// One tar: the .sbx directory, then every file to send; the blobs come from the object store,
	// so what is sent is exactly what was hashed.
	refDone := make(chan error, 1)
	if opt.SandboxID != "" && (!found || old.Commit != snap.Commit) {
		go func() { refDone <- repo.SetRef(ctx, RefPrefix+opt.SandboxID, snap.Commit) }()
	} else {
		refDone <- nil
	}
	sizes := make(map[string]int64, len(send))
	if len(send) > 0 || !found {
		b, err := repo.openBlobs(ctx)
		if err != nil {
			return res, err
		}
		defer b.close()
		pr, pw := io.Pipe()
		done := make(chan error, 1)
		var disk *os.Root
		if opt.Rev == "" {
			// The working tree's files are read where they are (cheaper than the object store's
			// loose objects); one that changed since the snapshot comes from the object store.
			if disk, err = os.OpenRoot(repo.Top); err != nil {
				return res, err
			}
			defer disk.Close()
		}
		go func() {
			err := writeTar(pw, b, disk, send, now, sizes)
			pw.CloseWithError(err)
			done <- err
		}()
		var src io.Reader = pr
		if opt.Wrap != nil {
			src = opt.Wrap(pr)
		}
		tres, err := dp.Untar(ctx, Workspace, src)
		pr.CloseWithError(errors.New("the push ended"))
		if lerr := <-done; err == nil && lerr != nil {
			err = lerr
		}
		if err != nil {
			return res, err
		}
		res.Bytes = tres.Bytes
		tr.mark("untar")
	}
	res.Sent = len(send)
	for _, e := range send {
		be := baseline.Entry{Path: e.Path, Mode: e.Mode, OID: e.OID, Size: sizes[e.Path]}
		if e.Mode != baseline.ModeSymlink {
			be.MtimeNS = now.UnixNano()
		}
		rec.Entries = append(rec.Entries, be)
	}
	slices.SortFunc(rec.Entries, func(a, b baseline.Entry) int { return strings.Compare(a.Path, b.Path) })

	if found && len(send) == 0 && len(del) == 0 && old.Commit == snap.Commit {
		return res, nil // up to date: the record stands
	}
	// The record last: written after the files, its mtime is what their ctimes are compared with.
	if err := <-refDone; err != nil {
		return res, err
	}
	var rb bytes.Buffer
	if err := rec.Write(&rb); err != nil {
		return res, err
	}
	tr.mark("set the ref")
	if _, err := dp.Upload(ctx, RecordPath, &rb); err != nil {
		return res, fmt.Errorf("recording the baseline: %w", err)
	}
	tr.mark("write the record")
	return res, nil
}

// writeTar writes the .sbx directory and the entries as a tar stream, all with mtime now. With a
// disk root, an entry whose file there still has the snapshot's type and size is read from it;
// the rest come from the object store.
func writeTar(w io.Writer, b *blobs, disk *os.Root, send []TreeEntry, now time.Time, sizes map[string]int64) error {
	tw := tar.NewWriter(w)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: path.Dir(protocol.BaselineRecord) + "/", Mode: 0o755, ModTime: now, Format: tar.FormatPAX}); err != nil {
		return err
	}
	// So that the agent's own git in the workspace does not list the baseline as untracked.
	ignore := []byte("*\n")
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: path.Dir(protocol.BaselineRecord) + "/.gitignore", Mode: 0o644, Size: int64(len(ignore)), ModTime: now, Format: tar.FormatPAX}); err != nil {
		return err
	}
	if _, err := tw.Write(ignore); err != nil {
		return err
	}
	buf := make([]byte, 256<<10)
	dirs := &dirCache{root: disk}
	defer dirs.close()
	for _, e := range send {
		hdr := &tar.Header{Name: e.Path, ModTime: now, Format: tar.FormatPAX, Typeflag: tar.TypeReg, Mode: 0o644}
		if e.Mode == baseline.ModeExec {
			hdr.Mode = 0o755
		}
		if disk != nil {
			ok, err := fromDisk(tw, disk, dirs, e, hdr, buf, sizes)
			if err != nil {
				return err
			}
			if ok {
				continue
			}
		}
		n, err := b.open(e.OID)
		if err != nil {
			return err
		}
		sizes[e.Path] = n
		if e.Mode == baseline.ModeSymlink {
			target := make([]byte, n)
			if _, err := io.ReadFull(b.out, target); err != nil {
				return err
			}
			hdr.Typeflag, hdr.Linkname, hdr.Mode = tar.TypeSymlink, string(target), 0o777
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
		} else {
			hdr.Size = n
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
			if _, err := io.CopyBuffer(tw, io.LimitReader(b.out, n), buf); err != nil {
				return err
			}
		}
		if err := b.done(); err != nil {
			return err
		}
	}
	return tw.Close()
}

// fromDisk writes e from the working tree when it is still what the snapshot saw there: ok false
// when it is not (the caller takes the blob instead). A symlink is read, never followed.
func fromDisk(tw *tar.Writer, disk *os.Root, dirs *dirCache, e TreeEntry, hdr *tar.Header, buf []byte, sizes map[string]int64) (bool, error) {
	if e.Mode == baseline.ModeSymlink {
		target, err := disk.Readlink(e.Path)
		if err != nil || baseline.BlobID([]byte(target)) != e.OID {
			return false, nil
		}
		hdr.Typeflag, hdr.Linkname, hdr.Mode = tar.TypeSymlink, target, 0o777
		sizes[e.Path] = int64(len(target))
		return true, tw.WriteHeader(hdr)
	}
	f, err := dirs.open(e.Path)
	if err != nil {
		return false, nil
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return false, nil
	}
	hdr.Size = fi.Size()
	if err := tw.WriteHeader(hdr); err != nil {
		return false, err
	}
	n, err := io.CopyBuffer(tw, io.LimitReader(f, fi.Size()), buf)
	if err == nil && n != fi.Size() {
		err = fmt.Errorf("%s shrank while it was pushed; push again once it stops changing", e.Path)
	}
	sizes[e.Path] = n
	return true, err
}

// emptied are the directories of deleted paths that the new tree has no file under, deepest
// first: git has no directories, so they go with their last file (and a file may take their name).
func emptied(del []string, entries []TreeEntry) []string {
	keep := map[string]bool{}
	for _, e := range entries {
		for d := path.Dir(e.Path); d != "." && !keep[d]; d = path.Dir(d) {
			keep[d] = true
		}
	}
	seen := map[string]bool{}
	var dirs []string
	for _, p := range del {
		for d := path.Dir(p); d != "." && !keep[d] && !seen[d]; d = path.Dir(d) {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	slices.SortFunc(dirs, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	return dirs
}

// deleteAll deletes the sandbox paths (relative to the workspace), a few at a time; one already
// gone is fine.
func deleteAll(ctx context.Context, dp *backend.Remote, paths []string) error {
	// Not errgroup.WithContext: a failed delete does not stop the others; the first error is the
	// one returned.
	var g errgroup.Group
	g.SetLimit(8)
	for _, p := range paths {
		g.Go(func() error {
			err := dp.Delete(ctx, protocol.DeleteArgs{Path: Workspace + "/" + p})
			var pe *protocol.Error
			// Gone already, or a file took a parent's place: nothing at that path either way.
			if err != nil && !(errors.As(err, &pe) && (pe.Code == protocol.CodeFileNotFound || pe.Code == protocol.CodeNotDirectory)) {
				return fmt.Errorf("deleting %s: %w", p, err)
			}
			return nil
		})
	}
	return g.Wait()
}

// dirCache keeps the directory of the last file read open, so that the next file of the same
// directory (a tree's files come sorted) is opened relative to it instead of walking the path from
// the root again.
type dirCache struct {
	root *os.Root
	name string
	dir  *os.File
}

func (c *dirCache) open(p string) (*os.File, error) {
	d, base := path.Split(p)
	d = strings.TrimSuffix(d, "/")
	if d == "" {
		d = "."
	}
	if c.dir == nil || c.name != d {
		c.close()
		dir, err := c.root.OpenFile(d, os.O_RDONLY|noFollow|dirFlag, 0)
		if err != nil {
			return nil, err
		}
		c.name, c.dir = d, dir
	}
	return openIn(c.root, c.dir, p, base)
}

func (c *dirCache) close() {
	if c.dir != nil {
		c.dir.Close()
		c.dir = nil
	}
}
