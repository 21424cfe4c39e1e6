//go:build unix

package baseline

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/protocol"
)

// TestChangesRecordFIFO: a FIFO for a record (the sandbox made it) is refused at once, not opened
// with a wait for a writer that would last forever while the request holds a broker-wide slot and
// cancel cannot end it.
func TestChangesRecordFIFO(t *testing.T) {
	dir, root := tree(t, map[string]string{"a.txt": "a"})
	rec := filepath.Join(dir, protocol.BaselineRecord)
	os.Remove(rec)
	if err := unix.Mkfifo(rec, 0o644); err != nil {
		t.Fatal(err)
	}
	fifo := make(chan error, 1)
	go func() { _, err := Changes(context.Background(), root, Options{}); fifo <- err }()
	select {
	case err := <-fifo:
		if !isCode(err, protocol.CodeInvalidArgument) {
			t.Fatalf("a FIFO for a record: %v", err)
		}
	case <-time.After(10 * time.Second):
		w, _ := os.OpenFile(rec, os.O_WRONLY, 0) // let the blocked open go
		w.Close()
		t.Fatal("a FIFO for a record: the open waited for a writer")
	}
}
