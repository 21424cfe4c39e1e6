package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/gitsync"
	"github.com/sbxbroker/broker/protocol"
)

// Counts of one read as one: "1 file", not "1 files".
func TestCountsOfOneAreSingular(t *testing.T) {
	one, oneByte := 1, int64(1)
	lines := []string{
		summary(protocol.TreeResult{Files: 1, Dirs: 1, Symlinks: 1, Bytes: 3}, time.Second),
		eventLine(protocol.Event{Type: protocol.EventSynced, Path: "/workspace", Files: &one, Bytes: &oneByte}, false),
	}
	var out bytes.Buffer
	g := &globals{stdout: &out, output: "table"}
	if err := g.printPush(gitsync.PushResult{Commit: strings.Repeat("a", 40), Sent: 1, Deleted: 1, Unchanged: 1}); err != nil {
		t.Fatal(err)
	}
	lines = append(lines, out.String())
	m := newWatchModel(t.Context(), nil, "http://b", "", nil)
	m.loaded, m.width, m.height = true, 120, 24
	m.sandboxes = []protocol.Sandbox{{ID: "sb_1", Name: "dev", Status: "running"}}
	lines = append(lines, strings.SplitN(regexp.MustCompile("\x1b\\[[0-9;]*m").ReplaceAllString(m.View(), ""), "\n", 2)[0])
	plural := regexp.MustCompile(`\b1 (files|dirs|symlinks|sandboxes|submodules|conflicts|paths|changed paths)\b`)
	for _, l := range lines {
		if plural.MatchString(l) {
			t.Errorf("a count of one in the plural: %q", l)
		}
	}
	if want := "1 file, 1 dir, 1 symlink"; !strings.Contains(lines[0], want) {
		t.Errorf("cp summary %q, want %q", lines[0], want)
	}
	if want := "1 sandbox"; !strings.Contains(lines[3], want) {
		t.Errorf("watch title %q, want %q", lines[3], want)
	}
}
