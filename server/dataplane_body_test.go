package server_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// bodyFrame is a protocol.FrameRequestBody as a client sends it.
func bodyFrame(id uint32, js string, body []byte) []byte {
	return protocol.AppendBodyFrame(nil, protocol.FrameRequestBody, id, []byte(js), body)
}

// TestDataplaneBodyFrames: a write's content arrives as the raw body of a binary frame and a
// read's leaves as one, byte for byte (NULs, invalid UTF-8); frames with a body that lie about
// their lengths or ids, carry a body to an op that takes none, or a write without one, are refused
// with a clear error and change nothing.
func TestDataplaneBodyFrames(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "bodies")
	ws := workspaceDir(b, id)
	key := b.Client.APIKey()
	c := dialRaw(t, url, key)
	if c.hello.Protocol != protocol.Subprotocol {
		t.Fatalf("hello says %q", c.hello.Protocol)
	}

	// Raw bytes both ways.
	content := append([]byte("text\x00\xff\xfe binary \xc3"), bytes.Repeat([]byte{0, 1, 2, 0xff}, 100_000)...)
	c.sendBinary(bodyFrame(1, `{"id":1,"op":"write","args":{"path":"bin.dat"}}`, content))
	var wr protocol.WriteResult
	if got := c.await(1); got.Error != nil || got.decode(&wr) != nil || wr.Size != int64(len(content)) || !wr.Created {
		t.Fatalf("write: %s", got)
	}
	if disk, _ := os.ReadFile(filepath.Join(ws, "bin.dat")); !bytes.Equal(disk, content) {
		t.Fatalf("the file holds %d bytes, not the %d written", len(disk), len(content))
	}
	c.sendJSON(protocol.Request{ID: 2, Op: "read", Args: map[string]any{"path": "bin.dat"}})
	got := c.await(2)
	var rr protocol.ReadHead
	if got.Error != nil || !bytes.Equal(got.body, content) || json_(got.Result, &rr) != nil || rr.Size != int64(len(content)) {
		t.Fatalf("read: %d bytes back, %s", len(got.body), got)
	}
	// An empty body is an empty file; a byte range comes back as it is.
	c.sendBinary(bodyFrame(3, `{"id":3,"op":"write","args":{"path":"empty.txt","mode":"create"}}`, nil))
	if got := c.await(3); got.Error != nil {
		t.Fatalf("empty write: %s", got)
	}
	c.sendJSON(protocol.Request{ID: 4, Op: "read", Args: map[string]any{"path": "bin.dat", "offset": 5, "length": 3}})
	if got := c.await(4); got.Error != nil || !bytes.Equal(got.body, content[5:8]) {
		t.Fatalf("byte range: %x %s", got.body, got)
	}

	before := snapshot(t, ws)
	// Frames that lie or misuse a body: each is refused and nothing changes.
	lie := bodyFrame(10, `{"id":10,"op":"write","args":{"path":"lie.txt"}}`, []byte("x"))
	binary.BigEndian.PutUint32(lie[protocol.FrameHeaderLen:], 1<<20) // a JSON length past the frame's end
	short := []byte{protocol.FrameRequestBody, 0, 0, 0, 11, 0, 0}    // no room for the JSON length
	cases := []struct {
		name  string
		frame []byte
		id    uint32 // the id the refusal is answered on
		code  string
		says  string
	}{
		{"json length past the end", lie, 0, "invalid_argument", "nothing was done"},
		{"no json length", short, 0, "invalid_argument", "4-byte JSON length"},
		{"ids differ", bodyFrame(12, `{"id":13,"op":"write","args":{"path":"ids.txt"}}`, []byte("x")), 0, "invalid_argument", "names request 12"},
		{"json not a request", bodyFrame(14, `{"id":14,"op":`, []byte("x")), 0, "invalid_json", "kind 5"},
		{"json not utf-8", bodyFrame(15, "{\"id\":15,\"op\":\"write\",\"args\":{\"path\":\"\xff.txt\"}}", []byte("x")), 0, "invalid_json", "kind 5"},
		{"content in the args", bodyFrame(16, `{"id":16,"op":"write","args":{"path":"c.txt","content":"x"}}`, []byte("y")), 16, "invalid_argument", "content"},
		{"a body for exec", bodyFrame(17, `{"id":17,"op":"exec","args":{"command":"touch pwned"}}`, []byte("x")), 17, "invalid_argument", "exec takes no body"},
		{"a body for ping", bodyFrame(18, `{"id":18,"op":"ping"}`, nil), 18, "invalid_argument", "takes no body"},
		{"a body for a cancel", bodyFrame(19, `{"id":19,"op":"cancel"}`, nil), 0, "invalid_argument", "takes no body"},
		{"a body for read", bodyFrame(20, `{"id":20,"op":"read","args":{"path":"bin.dat"}}`, []byte("x")), 20, "invalid_argument", "takes no body"},
		{"id 0", bodyFrame(0, `{"id":0,"op":"write","args":{"path":"zero.txt"}}`, []byte("x")), 0, "invalid_argument", "reserved"},
		{"unknown op", bodyFrame(21, `{"id":21,"op":"frobnicate"}`, []byte("x")), 21, "unknown_op", "frobnicate"},
		{"traversal", bodyFrame(22, `{"id":22,"op":"write","args":{"path":"../../escape.txt"}}`, []byte("x")), 22, "invalid_path", ""},
	}
	for _, tc := range cases {
		c.sendBinary(tc.frame)
		got := c.await(tc.id)
		if got.code() != tc.code || !strings.Contains(got.Error.Message, tc.says) {
			t.Errorf("%s: %s", tc.name, got)
		}
	}
	// A write sent as a text frame, as v1 did: refused, naming the frame to use.
	c.sendText(`{"id":30,"op":"write","args":{"path":"v1.txt","content":"x"}}`)
	if got := c.await(30); got.code() != "invalid_argument" || !strings.Contains(got.Error.Message, "kind 5") || !strings.Contains(got.Error.Message, protocol.Subprotocol) {
		t.Errorf("text write: %s", got)
	}
	c.sendText(`{"id":31,"op":"write","args":{"path":"v1.txt"}}`)
	if got := c.await(31); got.code() != "invalid_argument" {
		t.Errorf("text write without content: %s", got)
	}
	// A body frame whose id is in flight is ignored; the request in flight still gets its answer.
	c.sendJSON(protocol.Request{ID: 40, Op: "exec", Args: map[string]any{"command": "sleep 0.2"}})
	c.sendBinary(bodyFrame(40, `{"id":40,"op":"write","args":{"path":"dup.txt"}}`, []byte("x")))
	if got := c.await(0); got.code() != "invalid_argument" || !strings.Contains(got.Error.Message, "already in flight") {
		t.Errorf("a body frame on an id in flight: %s", got)
	}
	if got := c.await(40); got.Error != nil {
		t.Errorf("the exec in flight: %s", got)
	}
	c.ping()
	if after := snapshot(t, ws); !slices.Equal(before, after) {
		t.Errorf("refused frames changed the workspace: %v -> %v", before, after)
	}

	// A read-only token may not write through a body frame either.
	m, err := b.Client.Delegate(t.Context(), "bodies", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	ro := dialRaw(t, url, m.Token)
	ro.sendBinary(bodyFrame(1, `{"id":1,"op":"write","args":{"path":"bin.dat"}}`, []byte("overwritten")))
	if got := ro.await(1); got.code() != "scope_denied" {
		t.Errorf("read-only write: %s", got)
	}

	// A body frame over max_frame_bytes closes the connection (1009) and writes nothing.
	big := bodyFrame(50, `{"id":50,"op":"write","args":{"path":"big.txt"}}`, make([]byte, c.hello.Limits.MaxFrameBytes))
	// The server may close before the whole frame is written (it stops at the header's length): a
	// write error is fine, the close frame is what counts.
	go c.ws.WriteMessage(websocket.BinaryMessage, big)
	var ce *websocket.CloseError
	for {
		if err := c.readOne(20 * time.Second); err != nil {
			if !errors.As(err, &ce) || ce.Code != websocket.CloseMessageTooBig {
				t.Errorf("oversized body frame: %v", err)
			}
			break
		}
	}
	if after := snapshot(t, ws); !slices.Equal(before, after) {
		t.Errorf("an oversized frame changed the workspace: %v -> %v", before, after)
	}
	assertAlive(t, b, url, key)
}

// TestDataplaneRefusesOldProtocol: a client that offers only an older version of the dataplane is
// refused at the upgrade with an error naming its version and the broker's.
func TestDataplaneRefusesOldProtocol(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "old")
	status, eb := dialStatus(t, url, authHeader(b.Client.APIKey()), []string{"sbx.dataplane.v1"})
	if status != http.StatusBadRequest || eb.Error.Code != "invalid_argument" ||
		!strings.Contains(eb.Error.Message, "sbx.dataplane.v1") || !strings.Contains(eb.Error.Message, protocol.Subprotocol) {
		t.Fatalf("a v1 client: %d %+v", status, eb.Error)
	}
	if status, _ := dialStatus(t, url, authHeader(b.Client.APIKey()), []string{"sbx.dataplane.v1", protocol.Subprotocol}); status != http.StatusSwitchingProtocols {
		t.Fatalf("a client offering both: %d", status)
	}
}

// snapshot lists a directory tree's files with their contents, temporary files included.
func snapshot(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.IsDir() {
			return err
		}
		data, _ := os.ReadFile(p)
		rel, _ := filepath.Rel(dir, p)
		out = append(out, rel+"="+string(data[:min(len(data), 64)]))
		return nil
	})
	return out
}

func json_(raw []byte, v any) error { return (answer{Result: raw}).decode(v) }
