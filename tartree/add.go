// The writing side: a tree read through an os.Root, written as a tar stream.

package tartree

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"syscall"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/protocol"
)

// Add writes rel (a file, a symlink or a directory with everything below it, through root) to tw,
// named name and below. Symlinks are written as symlinks, never followed; FIFOs, sockets and devices
// are skipped and counted. A file that changes size while it is read is an error rather than a
// corrupt entry.
func Add(ctx context.Context, tw *tar.Writer, root *os.Root, rel, name string) (Stats, error) {
	var st Stats
	// Its copy buffer is held from here to its end, whatever the tree: drawn with the names.
	// (Extract's is its caller's to draw: the broker draws it with the untar's pipe, at its start.)
	mem := membudget.From(ctx)
	if err := mem.Grow(copyBuffer); err != nil {
		return st, err
	}
	defer mem.Shrink(copyBuffer)
	buf := make([]byte, copyBuffer)
	namesLeft := maxNamesHeld
	err := add(ctx, tw, root, rel, name, &st, buf, &namesLeft)
	// A walk that stopped early still held the names above where it stopped.
	mem.Shrink(maxNamesHeld - namesLeft)
	return st, err
}

// maxNamesHeld bounds the memory of the names one Add holds: a directory's names are read whole
// and sorted before its entries are written, and those of every directory above it are held
// meanwhile. Unbounded, one directory of a few hundred thousand long names (a sandbox chooses its
// tree) held hundreds of MB per tar, and a client may run two on each of its connections.
var maxNamesHeld int64 = 16 << 20

// readNames reads the names of the directory d in batches, drawing on left, and sorts them; past
// left it stops with an error naming the limit.
func readNames(ctx context.Context, d *os.File, rel string, left *int64) ([]string, error) {
	var names []string
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		batch, err := d.Readdirnames(1024)
		var cost int64
		for _, n := range batch {
			if cost += nameCost(n); *left-cost < 0 {
				return nil, protocol.Errorf(protocol.CodeInvalidArgument, "%s has more entries than one tar lists at once (%d MiB of names, with the directories above it): archive its parts separately", quote(rel), maxNamesHeld>>20)
			}
		}
		// The caller's budget, shared with other operations, may be spent before this one's is.
		if err := membudget.From(ctx).Grow(cost); err != nil {
			return nil, err
		}
		*left -= cost
		names = append(names, batch...)
		if errors.Is(err, io.EOF) || err == nil && len(batch) == 0 {
			slices.Sort(names)
			return names, nil
		}
		if err != nil {
			return nil, &EntryError{rel, err}
		}
	}
}

func add(ctx context.Context, tw *tar.Writer, root *os.Root, rel, name string, st *Stats, buf []byte, namesLeft *int64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	// The receiving side refuses longer names anyway; stopping here also bounds the depth a tree
	// can make this walk recurse to (and its cost, which grows with the square of the depth).
	if len(name) > MaxNameBytes {
		return &EntryError{rel, fmt.Errorf("its name is over %d bytes; copy a shallower part of the tree", MaxNameBytes)}
	}
	fi, err := root.Lstat(rel)
	if err != nil {
		return &EntryError{rel, err}
	}
	if testHookAfterLstat != nil {
		testHookAfterLstat(rel)
	}
	hdr := &tar.Header{Name: name, Mode: int64(fi.Mode().Perm()), ModTime: fi.ModTime(), Format: tar.FormatPAX}
	switch m := fi.Mode(); {
	case m.IsDir():
		d, err := root.OpenFile(rel, os.O_RDONLY|dirFlags, 0)
		if err != nil && (errors.Is(err, syscall.ENOTDIR) || swapped(root, rel, fi)) {
			// Swapped since the lstat for what is no directory (a FIFO, a file, a link to one or
			// out of the tree): skipped like a swapped file, not the end of the whole tar.
			st.Skipped++
			return nil
		}
		if err != nil {
			return &EntryError{rel, err}
		}
		// os.Root follows a link inside the tree whatever the flags: one swapped in since the
		// lstat is skipped like any other swap, not archived as the directory it leads to.
		if now, err := d.Stat(); err != nil || !os.SameFile(fi, now) {
			d.Close()
			st.Skipped++
			return nil
		}
		names, err := readNames(ctx, d, rel, namesLeft)
		d.Close()
		if err != nil {
			return err
		}
		hdr.Typeflag = tar.TypeDir
		hdr.Name += "/"
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		st.Dirs++
		for _, n := range names {
			if err := add(ctx, tw, root, join(rel, n), name+"/"+n, st, buf, namesLeft); err != nil {
				return err
			}
		}
		var cost int64
		for _, n := range names {
			cost += nameCost(n)
		}
		*namesLeft += cost // given back as the directory is done
		membudget.From(ctx).Shrink(cost)
		return nil
	case m&fs.ModeSymlink != 0:
		target, err := root.Readlink(rel)
		if err != nil && swapped(root, rel, fi) {
			st.Skipped++ // swapped for what is no link since the lstat
			return nil
		}
		if err != nil {
			return &EntryError{rel, err}
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		st.Symlinks++
		return tw.WriteHeader(hdr)
	case m.IsRegular():
		f, err := root.OpenFile(rel, os.O_RDONLY|readFlags, 0)
		if err != nil && swapped(root, rel, fi) {
			st.Skipped++ // swapped since the lstat, for a link the root will not follow (out of the tree)
			return nil
		}
		if err != nil {
			return &EntryError{rel, err}
		}
		defer f.Close()
		now, err := f.Stat()
		if err != nil {
			return &EntryError{rel, err}
		}
		if !now.Mode().IsRegular() || !os.SameFile(fi, now) {
			st.Skipped++ // swapped for something else (a link the root followed) since the lstat
			return nil
		}
		fi = now
		hdr.Typeflag, hdr.Size, hdr.Mode, hdr.ModTime = tar.TypeReg, fi.Size(), int64(fi.Mode().Perm()), fi.ModTime()
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		n, err := copyCtx(ctx, tw, io.LimitReader(f, fi.Size()), buf)
		st.Bytes += n
		if err != nil {
			return err
		}
		if n != fi.Size() {
			return protocol.Errorf(protocol.CodeInvalidArgument, "%s shrank from %d to %d bytes while it was copied; copy it again once it stops changing", quote(name), fi.Size(), n)
		}
		st.Files++
		return nil
	}
	st.Skipped++
	return nil
}

// swapped says whether rel, whose open or readlink failed, is no longer what fi was: the sandbox
// swapped it since the lstat (for a link leading out of the tree, say), which is skipped like any
// other swap rather than ending the whole tar. The type is compared too: a name removed and made
// again at once often gets the freed inode number back.
func swapped(root *os.Root, rel string, fi fs.FileInfo) bool {
	now, err := root.Lstat(rel)
	return err == nil && (now.Mode().Type() != fi.Mode().Type() || !os.SameFile(fi, now))
}

// testHookAfterLstat, when a test sets it, runs between an entry's lstat and its open (or readlink).
var testHookAfterLstat func(rel string)
