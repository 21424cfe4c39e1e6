package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
)

var bulkOnly = flag("bulk-only", "only the 100 MiB upload and download rows of issue 17, beside their floors, warm and cold")

// bulkReport prints the bulk rows alone.
func bulkReport(ctx context.Context, r *backend.Remote, br *brokerProc, wsDir string) error {
	fmt.Fprintln(os.Stderr, "bulk (issue 17)...")
	wsFloor, err := os.MkdirTemp(wsDir, ".floor-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(wsFloor)
	rows, err := bulkRows(ctx, r, br, wsDir, wsFloor)
	if err != nil {
		return err
	}
	for _, r := range rows {
		fmt.Printf("%s: %s (target %s; %s)\n", r.metric, r.ours, r.budget, r.baseline)
	}
	return nil
}

// coldSettle is how long each cold round waits for recently freed memory to go cold, and
// coldRounds how many such rounds the cold figures are the medians of.
const (
	coldSettle = 15 * time.Second
	coldRounds = 3
)

// bulkRounds is how many interleaved rounds the warm bulk figures are the medians of.
const bulkRounds = 5

// bulkRows measures 100 MiB uploads and downloads (issue 17) beside raw-TCP floors taken under the
// same conditions. On these VMs the conditions are most of the figure: the guest's balloon reports
// freed memory to the host (free page reporting), so a page the guest has not touched for a few
// seconds costs a host fault on its first touch, and writing 100 MiB into new page cache runs at a
// fraction of the speed of writing it into pages a file freed just before (docs/ARCHITECTURE.md, hot
// path). So the rows are measured in two ways, each beside floors that met the same memory:
//   - warm: rounds of floor, floor on the workspace's file system, upload, download and its floor,
//     one right after the other, each over the memory the one before freed; medians;
//   - cold: rounds that first wait for freed memory to be reported, then write the floors' files
//     and upload, in a different order each round, each keeping its file until the round ends so
//     that every one of them takes memory nothing freed recently; medians.
//
// Every upload and floor sends the same 100 MiB from the same memory, in 1 MiB writes, into a new
// file that is deleted after its round (replacing a file would also free the old one's pages
// inside the upload).
func bulkRows(ctx context.Context, r *backend.Remote, br *brokerProc, wsDir, wsFloor string) ([]row, error) {
	const size = 100 << 20
	data := make([]byte, size)
	rand.Read(data)
	load0 := loadAvg()
	rss0 := br.peakRSS()
	floorFile, wsFloorFile := filepath.Join(br.dir, "floor.bin"), filepath.Join(wsFloor, "floor.bin")
	defer os.Remove(floorFile)
	defer os.Remove(wsFloorFile)
	floor := func() (float64, error) { return tcpIntoFile(floorFile, data) }
	wsFloorUp := func() (float64, error) { return tcpIntoFile(wsFloorFile, data) }
	upload := func() (float64, error) {
		t := time.Now()
		if _, err := r.Upload(ctx, "bulk.bin", bytes.NewReader(data)); err != nil {
			return 0, err
		}
		return mibps(size, time.Since(t)), nil
	}
	clean := func() error {
		os.Remove(floorFile)
		os.Remove(wsFloorFile)
		return r.Delete(ctx, protocol.DeleteArgs{Path: "bulk.bin"})
	}

	var floors, wsFloors, ups, downs, downFloors []float64
	for range bulkRounds {
		f, err := floor()
		if err != nil {
			return nil, err
		}
		os.Remove(floorFile)
		wf, err := wsFloorUp()
		if err != nil {
			return nil, err
		}
		os.Remove(wsFloorFile)
		u, err := upload()
		if err != nil {
			return nil, err
		}
		t := time.Now()
		if got, err := r.Download(ctx, "bulk.bin", io.Discard); err != nil || got != size {
			return nil, fmt.Errorf("download: %d bytes, %v", got, err)
		}
		d := mibps(size, time.Since(t))
		// The floor sends the very file the download read, from the same page cache.
		df, err := fileOutTCP(filepath.Join(wsDir, "bulk.bin"))
		if err != nil {
			return nil, err
		}
		if err := clean(); err != nil {
			return nil, err
		}
		fmt.Fprintf(os.Stderr, "  warm: floor %.0f, on the workspace's fs %.0f, upload %.0f, download %.0f, its floor %.0f MiB/s\n", f, wf, u, d, df)
		floors, wsFloors, ups = append(floors, f), append(wsFloors, wf), append(ups, u)
		downs, downFloors = append(downs, d), append(downFloors, df)
	}
	rss1 := br.peakRSS()
	load1 := loadAvg()

	// Memory freed in the last seconds is still warm; the guest reports it to the host within
	// seconds (a rewrite 5 s after a delete already ran at a quarter of the speed, 20 s after at a
	// seventh), so each cold round first lets that happen.
	var coldFloors, coldWsFloors, coldUps []float64
	for i := range coldRounds {
		time.Sleep(coldSettle)
		got := [3]float64{}
		for j := range 3 {
			k := (i + j) % 3
			var err error
			switch k {
			case 0:
				got[k], err = floor()
			case 1:
				got[k], err = wsFloorUp()
			case 2:
				got[k], err = upload()
			}
			if err != nil {
				return nil, err
			}
		}
		if err := clean(); err != nil {
			return nil, err
		}
		fmt.Fprintf(os.Stderr, "  cold: floor %.0f, on the workspace's fs %.0f, upload %.0f MiB/s\n", got[0], got[1], got[2])
		coldFloors, coldWsFloors, coldUps = append(coldFloors, got[0]), append(coldWsFloors, got[1]), append(coldUps, got[2])
	}
	load2 := loadAvg()

	fl, wsFl, up := median(floors), median(wsFloors), median(ups)
	down, downFloor := median(downs), median(downFloors)
	cfl, cwsFl, cup := median(coldFloors), median(coldWsFloors), median(coldUps)
	return []row{
		{"100 MiB upload", fmt.Sprintf("%.0f MiB/s", up), ">= 80% of floor", "856", "282",
			fmt.Sprintf("raw TCP into a file %.0f MiB/s (%.0f%%), on the workspace's fs %.0f MiB/s (%.0f%%); medians of %d interleaved rounds over memory the round before freed; upload %s; broker peak RSS %d -> %d MiB; load %s -> %s",
				fl, 100*up/fl, wsFl, 100*up/wsFl, bulkRounds, spread(ups), rss0>>20, rss1>>20, load0, load1)},
		{"100 MiB upload, cold memory", fmt.Sprintf("%.0f MiB/s", cup), ">= 80% of floor", "", "",
			fmt.Sprintf("raw TCP into a file %.0f MiB/s (%.0f%%), on the workspace's fs %.0f MiB/s (%.0f%%); medians of %d rounds, each after %s for freed memory to go cold; upload %s; load %s",
				cfl, 100*cup/cfl, cwsFl, 100*cup/cwsFl, coldRounds, coldSettle, spread(coldUps), load2)},
		{"100 MiB download", fmt.Sprintf("%.0f MiB/s", down), ">= 80% of floor", "1391", "1761",
			fmt.Sprintf("the same file out over raw TCP %.0f MiB/s (%.0f%%); medians of %d interleaved rounds; download %s", downFloor, 100*down/downFloor, bulkRounds, spread(downs))},
	}, nil
}

func mibps(size int, d time.Duration) float64 { return float64(size) / (1 << 20) / d.Seconds() }

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// spread is the lowest and highest of v, for a reader to judge the median by.
func spread(v []float64) string {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return fmt.Sprintf("range %.0f-%.0f", s[0], s[len(s)-1])
}

// tcpIntoFile is the upload's floor: data sent over loopback TCP in 1 MiB writes into a new file at
// path, with no protocol at all (the receiver's io.Copy into the file is the kernel's splice). The
// file is left for the caller to remove, so that a cold measurement can keep its pages.
func tcpIntoFile(path string, data []byte) (float64, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		f, err := os.Create(path)
		if err != nil {
			done <- err
			return
		}
		_, err = io.CopyBuffer(f, c, make([]byte, 1<<20))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		done <- err
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		return 0, err
	}
	t := time.Now()
	for off := 0; off < len(data); off += 1 << 20 {
		if _, err := c.Write(data[off:min(off+1<<20, len(data))]); err != nil {
			c.Close()
			return 0, err
		}
	}
	c.Close()
	if err := <-done; err != nil {
		return 0, err
	}
	return mibps(len(data), time.Since(t)), nil
}

// fileOutTCP is the download's floor: the file at path read and sent over loopback TCP, received
// and discarded, with no protocol at all.
func fileOutTCP(path string) (float64, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		f, err := os.Open(path)
		if err != nil {
			return
		}
		defer f.Close()
		io.CopyBuffer(c, struct{ io.Reader }{f}, make([]byte, 1<<20))
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		return 0, err
	}
	defer c.Close()
	t := time.Now()
	n, err := io.CopyBuffer(io.Discard, c, make([]byte, 1<<20))
	if err == nil && n == 0 {
		err = fmt.Errorf("nothing came out of %s", path)
	}
	if err != nil {
		return 0, err
	}
	return mibps(int(n), time.Since(t)), nil
}
