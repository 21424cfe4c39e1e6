package workspace

import (
	"os"
	"sync"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// A workspace closed while reads are in flight never serves another directory's file: the
// descriptor of its root must not be freed, and its number reused by an open elsewhere, while a
// read still resolves a name against it.
func TestCloseDuringReadsNeverCrossesWorkspaces(t *testing.T) {
	t.Parallel()
	for round := range 300 {
		mine, other := t.TempDir(), t.TempDir()
		put(t, mine, "f.txt", "mine")
		put(t, other, "f.txt", "other")
		w, err := Open(mine, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Read(protocol.ReadArgs{Path: "f.txt"}); err != nil { // opens the root's descriptor
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		stop := make(chan struct{})
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					if r, err := w.Read(protocol.ReadArgs{Path: "f.txt"}); err == nil && r.Content != "mine" {
						t.Errorf("round %d: read %q through a closed workspace", round, r.Content)
					}
				}
			}()
		}
		// Close, then open directories at once: they take the lowest free descriptor numbers,
		// the one the closed root had among them.
		w.Close()
		var opened []*os.File
		for range 8 {
			if d, err := os.Open(other); err == nil {
				opened = append(opened, d)
			}
		}
		close(stop)
		wg.Wait()
		for _, d := range opened {
			d.Close()
		}
		if t.Failed() {
			return
		}
	}
}
