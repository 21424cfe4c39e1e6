package main

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/backend"
)

var treeOnly = flag("tree-only", "only the tree copy (untar/tar, sbctl cp's path)")

// repoTar is a generated repository-sized tree as one tar stream: 10,000 files of mixed sizes,
// about 100 MB, in 400 directories.
func repoTar() ([]byte, int64) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	rng := rand.New(rand.NewPCG(1, 2))
	chunk := make([]byte, 4<<20)
	for i := range chunk {
		chunk[i] = byte(rng.Uint32())
	}
	var total int64
	mtime := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)
	for d := 0; d < 400; d++ {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("repo/d%03d/", d), Mode: 0o755, ModTime: mtime})
		for f := 0; f < 25; f++ {
			size := 1 << (8 + rng.IntN(8)) // 256 B .. 32 KiB
			if rng.IntN(500) == 0 {
				size = 1<<20 + rng.IntN(1<<20) // a few large files
			}
			tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("repo/d%03d/f%02d.dat", d, f), Mode: 0o644, Size: int64(size), ModTime: mtime})
			off := rng.IntN(len(chunk) - size)
			tw.Write(chunk[off : off+size])
			total += int64(size)
		}
	}
	tw.Close()
	return buf.Bytes(), total
}

// workspaceDir is where a sandbox's workspace is on the host, under the bench broker's data dir:
// the floors extract there, into the same file system as the broker's untar (a loop-mounted
// image when the sandbox has a disk quota, whose speed has little to do with the data dir's).
func workspaceDir(brokerDir, sandboxID string) string {
	return filepath.Join(brokerDir, "data", "sandboxes", sandboxID, "workspace")
}

// treeRows copies the generated tree into the sandbox (untar) and out (tar), beside GNU tar
// reading the same stream (bytes made in memory, no tar c) from loopback TCP into a new directory
// of dir, the sandbox's workspace on the host (workspaceDir).
func treeRows(ctx context.Context, r *backend.Remote, dir string, peakRSS func() int64) ([]row, error) {
	data, content := repoTar()
	defer extracted.removeAll()
	// The floor runs before and after ours and the faster counts; each timed copy starts with the
	// disk's dirty pages written back, or it pays for the one before's 100 MB.
	syscall.Sync()
	floor1, err := tarOverTCP(data, dir)
	if err != nil {
		return nil, err
	}
	rssBefore := peakRSS()
	syscall.Sync()
	in := time.Now()
	res, err := r.Untar(ctx, "tree", bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	inTook := time.Since(in)
	out := time.Now()
	if _, err := r.Tar(ctx, "tree/repo", io.Discard); err != nil {
		return nil, err
	}
	outTook := time.Since(out)
	rssAfter := peakRSS()
	syscall.Sync()
	floor, err := tarOverTCP(data, dir)
	if err != nil {
		return nil, err
	}
	floor = min(floor, floor1)
	mb := float64(content) / 1e6
	return []row{
		{fmt.Sprintf("tree in (untar, %d files, %.0f MB)", res.Files, mb), fmt.Sprintf("%.0f ms, %.0f MB/s", ms(inTook), mb/inTook.Seconds()), ">= 80% of tar over TCP", "", "",
			fmt.Sprintf("tar x of the same in-memory stream over loopback TCP into the workspace: %.0f ms, %.0f MB/s (untar at %.0f%% of it)", ms(floor), mb/floor.Seconds(), 100*floor.Seconds()/inTook.Seconds())},
		{"tree out (tar)", fmt.Sprintf("%.0f ms, %.0f MB/s", ms(outTook), mb/outTook.Seconds()), "", "", "",
			fmt.Sprintf("broker peak RSS %d -> %d MiB across both", rssBefore>>20, rssAfter>>20)},
	}, nil
}

// extracted are the floors' trees, removed once every copy of a report is timed (removeAll), never
// between two timed copies: ext4 makes new inodes slow for a minute or more after many were
// deleted (the allocator skips each recently deleted one, checking its inode table block:
// recently_deleted and find_inode_bit in a profile), so a copy timed right after a floor's 10,000
// files went paid for their deletion, and the floor measured first did not. That alone put the
// first push at 44-51% of the floor.
var extracted trees

type trees struct{ dirs []string }

func (t *trees) add(dir string) { t.dirs = append(t.dirs, dir) }

func (t *trees) removeAll() {
	for _, d := range t.dirs {
		os.RemoveAll(d)
	}
	t.dirs = nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// tarOverTCP times GNU tar extracting data read from a loopback TCP connection into a new
// directory under dir.
func tarOverTCP(data []byte, dir string) (time.Duration, error) {
	target, err := os.MkdirTemp(dir, "tar-floor-")
	if err != nil {
		return 0, err
	}
	extracted.add(target)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	go func() {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			return
		}
		c.Write(data)
		c.Close()
	}()
	c, err := l.Accept()
	if err != nil {
		return 0, err
	}
	defer c.Close()
	start := time.Now()
	cmd := exec.Command("tar", "x", "-C", filepath.Clean(target))
	cmd.Stdin = c
	if out, err := cmd.CombinedOutput(); err != nil {
		return 0, fmt.Errorf("tar x: %v: %s", err, out)
	}
	return time.Since(start), nil
}
