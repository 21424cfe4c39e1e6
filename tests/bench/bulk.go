package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
)

var bulkOnly = flag("bulk-only", "only the 100 MiB upload and download rows of issue 17, beside their floors, warm and cold")

// bulkReport prints the bulk rows alone.
func bulkReport(ctx context.Context, r *backend.Remote, blk protocol.SandboxBlock, br *brokerProc, wsDir string) error {
	fmt.Fprintln(os.Stderr, "bulk (issue 17)...")
	rows, err := bulkRows(ctx, r, blk, br, wsDir)
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
	coldRounds = 4
)

// bulkRounds is how many interleaved rounds the warm bulk figures are the medians of.
const bulkRounds = 5

// bulkRows measures 100 MiB uploads and downloads (issue 17) beside raw-TCP floors taken under the
// same conditions, and the upload both ways the broker takes it: backend.Remote.Upload (the HTTP
// door) and the upload operation over the WebSocket (wsUpload, what Remote.Upload sent before). On
// these VMs the conditions are most of the figure: the guest's balloon reports freed memory to the
// host (free page reporting), so a page the guest has not touched for a few seconds costs a host
// fault on its first touch, and writing 100 MiB into new page cache runs at a fraction of the speed
// of writing it into pages a file freed just before (docs/ARCHITECTURE.md, hot path). So:
//   - warm: rounds of the four ways in (floor, floor on the workspace's file system, upload,
//     upload over the WebSocket) in an order that rotates, each right after the step before and
//     over the memory it freed; the download and its floor follow the upload; medians, after a
//     first round that is not counted;
//   - cold: rounds that first wait for freed memory to be reported, then run the four ways and a
//     plain write of the same bytes into a new file (no socket) in a rotating order, each keeping
//     its file until the round ends so that none of them takes memory another freed; medians.
//
// Every upload and floor sends the same 100 MiB from the same memory into a new file, deleted
// after its step (replacing a file would also free the old one's pages inside the upload).
func bulkRows(ctx context.Context, r *backend.Remote, blk protocol.SandboxBlock, br *brokerProc, wsDir string) ([]row, error) {
	const size = 100 << 20
	data := make([]byte, size)
	rand.Read(data)
	load0 := loadAvg()
	rss0 := br.peakRSS()
	// The files on the workspace's fs are in the directory the uploads write to, as ext4 places a
	// file's blocks near its directory's.
	floorFile, wsFloorFile := filepath.Join(br.dir, "floor.bin"), filepath.Join(wsDir, ".floor.bin")
	plainFile := filepath.Join(wsDir, ".plain.bin")
	defer os.Remove(floorFile)
	defer os.Remove(wsFloorFile)
	defer os.Remove(plainFile)
	timed := func(f func() error) (float64, error) {
		t := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		return mibps(size, time.Since(t)), nil
	}
	// The four ways in, each keeping its file until deleted.
	ways := []func() (float64, error){
		func() (float64, error) { return tcpIntoFile(floorFile, data) },
		func() (float64, error) { return tcpIntoFile(wsFloorFile, data) },
		func() (float64, error) {
			return timed(func() error { _, err := r.Upload(ctx, "bulk.bin", bytes.NewReader(data)); return err })
		},
		// The upload operation over the WebSocket, as the Go client sent it before the HTTP door.
		func() (float64, error) { return timed(func() error { return wsUpload(ctx, blk, "bulk-ws.bin", data) }) },
		// No socket at all: the same bytes written into a new file on the workspace's fs.
		func() (float64, error) { return timed(func() error { return writeFile(plainFile, data) }) },
	}
	const floorWay, wsFloorWay, httpWay, wsWay, plainWay = 0, 1, 2, 3, 4
	del := func(way int) error {
		switch way {
		case floorWay:
			return os.Remove(floorFile)
		case wsFloorWay:
			return os.Remove(wsFloorFile)
		case httpWay:
			return r.Delete(ctx, protocol.DeleteArgs{Path: "bulk.bin"})
		case plainWay:
			return os.Remove(plainFile)
		}
		return r.Delete(ctx, protocol.DeleteArgs{Path: "bulk-ws.bin"})
	}

	var warm [4][]float64
	var downs, downFloors []float64
	// Round 0 warms up and is not counted: whichever way first writes a region of the workspace's
	// image that was never written pays for it (and the cold rows show what first writes cost).
	for i := range bulkRounds + 1 {
		var got [4]float64
		var down, downFloor float64
		for j := range 4 {
			way := (i + j) % 4
			v, err := ways[way]()
			if err != nil {
				return nil, err
			}
			got[way] = v
			if way == httpWay {
				t := time.Now()
				if n, err := r.Download(ctx, "bulk.bin", io.Discard); err != nil || n != size {
					return nil, fmt.Errorf("download: %d bytes, %v", n, err)
				}
				down = mibps(size, time.Since(t))
				// The floor sends the very file the download read, from the same page cache.
				if downFloor, err = fileOutTCP(filepath.Join(wsDir, "bulk.bin")); err != nil {
					return nil, err
				}
			}
			if err := del(way); err != nil {
				return nil, err
			}
		}
		fmt.Fprintf(os.Stderr, "  warm: floor %.0f, on the workspace's fs %.0f, upload %.0f, over the WebSocket %.0f, download %.0f, its floor %.0f MiB/s\n",
			got[0], got[1], got[2], got[3], down, downFloor)
		if i == 0 {
			continue
		}
		downs, downFloors = append(downs, down), append(downFloors, downFloor)
		for way, v := range got {
			warm[way] = append(warm[way], v)
		}
	}
	rss1 := br.peakRSS()
	load1 := loadAvg()

	// Memory freed in the last seconds is still warm; the guest reports it to the host within
	// seconds (a rewrite 5 s after a delete already ran at a quarter of the speed, 20 s after at a
	// seventh), so each cold round first lets that happen, and keeps every file until its end.
	var cold [5][]float64
	for i := range coldRounds {
		time.Sleep(coldSettle)
		var got [5]float64
		for j := range 5 {
			way := (i + j) % 5
			v, err := ways[way]()
			if err != nil {
				return nil, err
			}
			got[way] = v
		}
		for way := range 5 {
			if err := del(way); err != nil {
				return nil, err
			}
		}
		fmt.Fprintf(os.Stderr, "  cold: floor %.0f, on the workspace's fs %.0f, upload %.0f, over the WebSocket %.0f, a plain write %.0f MiB/s\n", got[0], got[1], got[2], got[3], got[4])
		for way, v := range got {
			cold[way] = append(cold[way], v)
		}
	}
	load2 := loadAvg()

	upRow := func(metric string, m [][]float64, how string) row {
		fl, wsFl, up, ws := median(m[floorWay]), median(m[wsFloorWay]), median(m[httpWay]), median(m[wsWay])
		return row{metric, fmt.Sprintf("%.0f MiB/s", up), ">= 80% of floor", "856", "282",
			fmt.Sprintf("raw TCP into a file %.0f MiB/s (%.0f%%), on the workspace's fs %.0f MiB/s (%.0f%%); the upload over the WebSocket %.0f MiB/s (%.0f%%, %.0f%%); %s; upload %s",
				fl, 100*up/fl, wsFl, 100*up/wsFl, ws, 100*ws/fl, 100*ws/wsFl, how, spread(m[httpWay]))}
	}
	warmRow := upRow("100 MiB upload", warm[:], fmt.Sprintf("medians of %d interleaved rounds over memory the step before freed; broker peak RSS %d -> %d MiB; load %s -> %s",
		bulkRounds, rss0>>20, rss1>>20, load0, load1))
	coldRow := upRow("100 MiB upload, cold memory", cold[:], fmt.Sprintf("a plain write of the same bytes into a new file on the workspace's fs, no socket, %.0f MiB/s; medians of %d rounds, each after %s for freed memory to go cold; load %s",
		median(cold[plainWay]), coldRounds, coldSettle, load2))
	coldRow.e2b, coldRow.daytona = "", ""
	down, downFloor := median(downs), median(downFloors)
	return []row{warmRow, coldRow,
		{"100 MiB download", fmt.Sprintf("%.0f MiB/s", down), ">= 80% of floor", "1391", "1761",
			fmt.Sprintf("the same file out over raw TCP %.0f MiB/s (%.0f%%); medians of %d interleaved rounds; download %s", downFloor, 100*down/downFloor, bulkRounds, spread(downs))},
	}, nil
}

// wsUpload sends data to path with the dataplane's upload operation over a WebSocket of its own, as
// backend.Remote did before the HTTP door: 1 MiB data frames, each copied from the source into a
// buffer, then into gorilla's write buffer, where it is masked (RFC 6455).
func wsUpload(ctx context.Context, blk protocol.SandboxBlock, path string, data []byte) error {
	d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol}, ReadBufferSize: 64 << 10, WriteBufferSize: 1<<20 + 64<<10 + 64}
	ws, _, err := d.DialContext(ctx, blk.DataplaneURL, http.Header{"Authorization": {"Bearer " + blk.Credential}})
	if err != nil {
		return err
	}
	defer ws.Close()
	if _, _, err := ws.ReadMessage(); err != nil { // hello
		return err
	}
	req, _ := json.Marshal(protocol.Request{ID: 1, Op: protocol.OpUpload, Args: protocol.UploadArgs{Path: path}})
	if err := ws.WriteMessage(websocket.TextMessage, req); err != nil {
		return err
	}
	src := bytes.NewReader(data)
	buf := make([]byte, protocol.FrameHeaderLen+1<<20)
	for {
		n, err := io.ReadFull(src, buf[protocol.FrameHeaderLen:])
		if n > 0 {
			protocol.PutFrameHeader(buf, protocol.FrameData, 1)
			if err := ws.WriteMessage(websocket.BinaryMessage, buf[:protocol.FrameHeaderLen+n]); err != nil {
				return err
			}
		}
		if err != nil {
			break
		}
	}
	protocol.PutFrameHeader(buf, protocol.FrameEnd, 1)
	if err := ws.WriteMessage(websocket.BinaryMessage, buf[:protocol.FrameHeaderLen]); err != nil {
		return err
	}
	_, answer, err := ws.ReadMessage()
	if err != nil {
		return err
	}
	var resp struct {
		Error *protocol.Error `json:"error"`
	}
	if json.Unmarshal(answer, &resp) != nil || resp.Error != nil {
		return fmt.Errorf("upload over the WebSocket: %s", answer)
	}
	return nil
}

// writeFile writes data into a new file at path in 1 MiB writes.
func writeFile(path string, data []byte) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	for off := 0; off < len(data); off += 1 << 20 {
		if _, err := f.Write(data[off:min(off+1<<20, len(data))]); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
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
