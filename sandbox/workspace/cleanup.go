package workspace

import (
	"context"
	"errors"
	"io/fs"
	"strings"

	"golang.org/x/sys/unix"
)

// isTempName reports whether name is one createTemp makes: the prefix and 16 hex digits. The
// exact shape keeps a tenant's own ".sbx-tmp-notes" listed.
func isTempName(name string) bool {
	hex, ok := strings.CutPrefix(name, tempPrefix)
	if !ok || len(hex) != 16 {
		return false
	}
	for _, c := range hex {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func (w *Workspace) holdTemp(rel string) {
	w.liveMu.Lock()
	if w.live == nil {
		w.live = map[string]struct{}{}
	}
	w.live[rel] = struct{}{}
	w.liveMu.Unlock()
}

func (w *Workspace) dropTemp(rel string) {
	w.liveMu.Lock()
	delete(w.live, rel)
	w.liveMu.Unlock()
}

func (w *Workspace) isLive(rel string) bool {
	w.liveMu.Lock()
	defer w.liveMu.Unlock()
	_, ok := w.live[rel]
	return ok
}

// SweepTemps removes the temporary files that uploads and writes left in the workspace when the
// broker died under them (an interrupted upload on a live broker removes its own). It skips this
// Workspace's uploads in progress, so it is safe beside them; another broker process writing to
// the same directory is not expected. It walks like Glob: through directory descriptors, never
// following a symlink, at most MaxScanEntries entries, checking ctx between batches, and removes
// only regular files and symlinks with a temporary file's exact name (unlinkat never follows).
// It returns how many it removed.
func (w *Workspace) SweepTemps(ctx context.Context) (int, error) {
	sc := w.newScan(ctx)
	sc.temps = true
	d, names, err := w.openDir(".", sc)
	if err != nil {
		return 0, err
	}
	defer d.Close()
	n := 0
	err = w.sweep(d, ".", names, sc, &n, 0)
	return n, err
}

func (w *Workspace) sweep(d *dir, rel string, names []string, sc *scan, n *int, depth int) error {
	for _, name := range names {
		fi, err := d.lstat(name)
		if err != nil {
			continue // vanished
		}
		switch {
		case fi.IsDir() && depth < maxWalkDepth:
			sd, subNames, err := openSub(d, name, fi, sc)
			if err != nil {
				if ctxErr(sc.ctx) != nil {
					return err
				}
				continue // swapped or unreadable: not ours to judge
			}
			err = w.sweep(sd, join(rel, name), subNames, sc, n, depth+1)
			sd.Close()
			if err != nil {
				return err
			}
		case isTempName(name) && (fi.Mode().IsRegular() || fi.Mode()&fs.ModeSymlink != 0):
			if w.isLive(join(rel, name)) {
				continue
			}
			var uerr error
			if cerr := d.rc.Control(func(fd uintptr) {
				uerr = ignoringEINTR(func() error { return unix.Unlinkat(int(fd), name, 0) })
			}); cerr != nil {
				return cerr
			}
			if uerr == nil {
				*n++
			} else if !errors.Is(uerr, unix.ENOENT) {
				return &fs.PathError{Op: "unlinkat", Path: join(rel, name), Err: uerr}
			}
		}
	}
	return nil
}
