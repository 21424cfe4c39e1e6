package server_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// File operations on the wire stay bounded: a line window deep in a 200 GiB sparse file is refused
// after the 64 MiB scan (it read all of it before, for minutes), and ls of a directory over the
// 10,000-entry cap says truncated.
func TestDataplaneFileOpsBounded(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "bounds")
	ws := workspaceDir(b, id)
	f, err := os.Create(filepath.Join(ws, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("one\ntwo\n")
	if err := f.Truncate(200 << 30); err != nil { // a hole: no disk
		t.Fatal(err)
	}
	f.Close()
	big := filepath.Join(ws, "big")
	if err := os.Mkdir(big, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range 10_050 {
		f, err := os.Create(filepath.Join(big, fmt.Sprintf("f%05d", i)))
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}

	c := dialRaw(t, url, b.Client.APIKey())
	got := c.call(1, protocol.OpRead, protocol.ReadArgs{Path: "huge", LineOffset: 1_000_000, LineLimit: 10})
	if got.code() != protocol.CodeTooLarge || !strings.Contains(got.Error.Message, "64 MiB") {
		t.Fatalf("deep line window: %s", got)
	}
	var rr protocol.ReadResult
	if got := c.call(2, protocol.OpRead, protocol.ReadArgs{Path: "huge", LineLimit: 2}); got.Error != nil || got.decode(&rr) != nil ||
		rr.Content != "one\ntwo\n" || !rr.TotalLinesPartial {
		t.Fatalf("first lines: %s %+v", got, rr)
	}
	var ls protocol.LsResult
	if got := c.call(3, protocol.OpLs, protocol.LsArgs{Path: "big"}); got.Error != nil || got.decode(&ls) != nil ||
		!ls.Truncated || len(ls.Entries) != 10_000 || ls.Entries[9_999].Name != "f09999" {
		t.Fatalf("ls of 10,050 entries: %v, %d entries, truncated %v", got.Error, len(ls.Entries), ls.Truncated)
	}
	c.ping()
}
