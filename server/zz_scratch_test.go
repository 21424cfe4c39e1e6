package server_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

func TestScratchBigAnswers(t *testing.T) {
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "big")
	ws := workspaceDir(b, id)
	os.WriteFile(filepath.Join(ws, "big.txt"), bytes.Repeat([]byte("0123456789abcde\n"), 8<<20/16), 0o644)
	f, _ := os.Create(filepath.Join(ws, "huge.bin"))
	f.Truncate(256 << 20)
	f.Close()
	for _, op := range []string{"read", "download"} {
		base := heapInuse()
		c := dialRaw(t, url, b.Client.APIKey())
		path := "big.txt"
		if op == "download" {
			path = "huge.bin"
		}
		for i := 1; i <= 64; i++ {
			c.sendJSON(protocol.Request{ID: uint32(i), Op: op, Args: map[string]any{"path": path}})
		}
		var peak uint64
		for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
			peak = max(peak, heapInuse())
		}
		t.Logf("%s x64, one connection not reading: heap %d MiB -> %d MiB", op, base>>20, peak>>20)
		c.ws.Close()
		time.Sleep(500 * time.Millisecond)
	}
	// exec streams
	base := heapInuse()
	c := dialRaw(t, url, b.Client.APIKey())
	for i := 1; i <= 64; i++ {
		c.sendJSON(protocol.Request{ID: uint32(i), Op: "exec", Args: map[string]any{"command": "yes", "stream": true, "max_output": 64 << 20}})
	}
	var peak uint64
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		peak = max(peak, heapInuse())
	}
	t.Logf("stream exec x64: heap %d MiB -> %d MiB", base>>20, peak>>20)
	base = heapInuse()
	c = dialRaw(t, url, b.Client.APIKey())
	for i := 1; i <= 64; i++ {
		c.sendJSON(protocol.Request{ID: uint32(i), Op: "exec", Args: map[string]any{"command": "yes | head -c 60000000", "max_output": 64 << 20}})
	}
	peak = 0
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		peak = max(peak, heapInuse())
	}
	t.Logf("buffered exec x64 (60 MB each): heap %d MiB -> %d MiB", base>>20, peak>>20)
}
