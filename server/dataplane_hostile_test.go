package server_test

// Hostile-input tests of the dataplane protocol (docs/dataplane.md), driven frame by frame with
// gorilla/websocket so that each test sends exactly the bytes it means: malformed frames, oversized
// frames, stray binary frames, too many requests, path attacks, clients that never read, and
// cancellation. Each ends by proving the broker still serves a fresh connection and the REST API.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// answer is a server text frame ending a request, and the binary frames that came for it before.
type answer struct {
	ID     uint32          `json:"id"`
	Result json.RawMessage `json:"result"`
	Error  *protocol.Error `json:"error"`
	bin    [][]byte
	body   []byte // the body of a protocol.FrameAnswerBody
}

func (a answer) code() string {
	if a.Error == nil {
		return ""
	}
	return a.Error.Code
}

func (a answer) decode(v any) error { return json.Unmarshal(a.Result, v) }

func (a answer) String() string {
	if a.Error != nil {
		return fmt.Sprintf("id %d error %s: %s", a.ID, a.Error.Code, a.Error.Message)
	}
	r := string(a.Result)
	if len(r) > 300 {
		r = r[:300] + "..."
	}
	return fmt.Sprintf("id %d result %s", a.ID, r)
}

// rawConn is a dataplane connection driven frame by frame. Answers and binary frames read while
// waiting for another request are kept for a later await.
type rawConn struct {
	t       testing.TB
	ws      *websocket.Conn
	hello   protocol.Hello
	answers map[uint32][]answer
	bins    map[uint32][][]byte
	// all receives every frame read, when set (to look for leaked secrets).
	all *bytes.Buffer
}

func workspaceDir(b *servertest.Broker, id string) string {
	return filepath.Join(b.DataDir, "sandboxes", id, "workspace")
}

func dataplaneURL(b *servertest.Broker, ref string) string { return b.Client.DataplaneURL(ref) }

func authHeader(cred string) http.Header { return http.Header{"Authorization": {"Bearer " + cred}} }

// dialRaw opens a connection with cred in the Authorization header and reads its hello.
func dialRaw(t testing.TB, url, cred string) *rawConn {
	t.Helper()
	d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol}, HandshakeTimeout: 10 * time.Second,
		WriteBufferSize: 2 << 20}
	ws, resp, err := d.Dial(url, authHeader(cred))
	if err != nil {
		body := ""
		if resp != nil {
			b, _ := io.ReadAll(resp.Body)
			body = string(b)
		}
		t.Fatalf("dial %s: %v %s", url, err, body)
	}
	t.Cleanup(func() { ws.Close() })
	c := &rawConn{t: t, ws: ws}
	c.readHello()
	return c
}

func (c *rawConn) readHello() {
	c.t.Helper()
	c.ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	var first protocol.Response
	if err := c.ws.ReadJSON(&first); err != nil || first.Type != "hello" || first.Hello == nil || first.ID != 0 {
		c.t.Fatalf("no hello: %v %+v", err, first)
	}
	c.hello = *first.Hello
}

// dialStatus tries an upgrade and returns the HTTP status and error body (101 and nothing when
// the upgrade succeeds; the connection is closed at once).
func dialStatus(t testing.TB, url string, hdr http.Header, protos []string) (int, protocol.ErrorBody) {
	t.Helper()
	d := websocket.Dialer{Subprotocols: protos, HandshakeTimeout: 10 * time.Second}
	ws, resp, err := d.Dial(url, hdr)
	if err == nil {
		ws.Close()
		return resp.StatusCode, protocol.ErrorBody{}
	}
	if resp == nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	var eb protocol.ErrorBody
	json.NewDecoder(resp.Body).Decode(&eb)
	return resp.StatusCode, eb
}

// dialPipelined upgrades and sends reqs at once, before reading the hello. It returns the
// connection, or the refusal.
func dialPipelined(t testing.TB, url, cred string, reqs []protocol.Request) (*websocket.Conn, int, protocol.ErrorBody) {
	t.Helper()
	d := websocket.Dialer{Subprotocols: []string{protocol.Subprotocol}, HandshakeTimeout: 10 * time.Second}
	ws, resp, err := d.Dial(url, authHeader(cred))
	if err != nil {
		if resp == nil {
			t.Fatalf("dial %s: %v", url, err)
		}
		var eb protocol.ErrorBody
		json.NewDecoder(resp.Body).Decode(&eb)
		return nil, resp.StatusCode, eb
	}
	for _, r := range reqs {
		req, _ := json.Marshal(r)
		ws.WriteMessage(websocket.TextMessage, req)
	}
	ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	return ws, 101, protocol.ErrorBody{}
}

func (c *rawConn) sendText(s string) {
	c.t.Helper()
	if err := c.ws.WriteMessage(websocket.TextMessage, []byte(s)); err != nil {
		c.t.Fatalf("send: %v", err)
	}
}

func (c *rawConn) sendJSON(req protocol.Request) {
	c.t.Helper()
	if req.Op == protocol.OpWrite {
		c.sendWrite(req)
		return
	}
	b, err := json.Marshal(req)
	if err != nil {
		c.t.Fatal(err)
	}
	c.sendText(string(b))
}

// sendWrite sends a write as a v2 client does: its content (args' "content", as v1 carried it) as
// the body of a protocol.FrameRequestBody, the other args in its JSON.
func (c *rawConn) sendWrite(req protocol.Request) {
	c.t.Helper()
	raw, _ := json.Marshal(req.Args)
	var args map[string]any
	json.Unmarshal(raw, &args)
	content, _ := args["content"].(string)
	delete(args, "content")
	req.Args = args
	js, err := json.Marshal(req)
	if err != nil {
		c.t.Fatal(err)
	}
	c.sendBinary(protocol.AppendBodyFrame(nil, protocol.FrameRequestBody, req.ID, js, []byte(content)))
}

func (c *rawConn) sendBinary(b []byte) {
	c.t.Helper()
	if err := c.ws.WriteMessage(websocket.BinaryMessage, b); err != nil {
		c.t.Fatalf("send binary: %v", err)
	}
}

func dataFrame(kind byte, id uint32, payload []byte) []byte {
	b := make([]byte, protocol.FrameHeaderLen+len(payload))
	protocol.PutFrameHeader(b, kind, id)
	copy(b[protocol.FrameHeaderLen:], payload)
	return b
}

// readOne reads the next frame into the pending answers or binary frames.
func (c *rawConn) readOne(timeout time.Duration) error {
	c.ws.SetReadDeadline(time.Now().Add(timeout))
	mt, data, err := c.ws.ReadMessage()
	if err != nil {
		return err
	}
	if c.all != nil {
		c.all.Write(data)
	}
	if c.answers == nil {
		c.answers, c.bins = map[uint32][]answer{}, map[uint32][][]byte{}
	}
	if mt == websocket.BinaryMessage {
		kind, id, payload, err := protocol.ParseFrame(data)
		if err != nil {
			return fmt.Errorf("server sent a short binary frame: %w", err)
		}
		if kind != protocol.FrameAnswerBody {
			c.bins[id] = append(c.bins[id], append([]byte{kind}, payload...))
			return nil
		}
		// An answer with a body (a read's): the result gets the content back as v1 carried it, so
		// that tests read it alike.
		js, body, err := protocol.SplitBody(payload)
		if err != nil {
			return fmt.Errorf("server sent a bad frame with a body: %w", err)
		}
		var a answer
		if err := json.Unmarshal(js, &a); err != nil || a.ID != id {
			return fmt.Errorf("server sent a frame with a body for %d whose JSON is %q", id, js)
		}
		var head protocol.ReadHead
		if err := json.Unmarshal(a.Result, &head); err != nil {
			return fmt.Errorf("server sent a read head %q: %w", a.Result, err)
		}
		a.Result, _ = json.Marshal(head.Result(string(body)))
		a.body = body
		c.answers[a.ID] = append(c.answers[a.ID], a)
		return nil
	}
	var a answer
	if err := json.Unmarshal(data, &a); err != nil {
		return fmt.Errorf("server sent a text frame that is not JSON: %q", data)
	}
	c.answers[a.ID] = append(c.answers[a.ID], a)
	return nil
}

// await returns the next answer for id, with the binary frames that came for id before it.
func (c *rawConn) await(id uint32) answer {
	c.t.Helper()
	for {
		if list := c.answers[id]; len(list) > 0 {
			a := list[0]
			c.answers[id] = list[1:]
			a.bin, c.bins[id] = c.bins[id], nil
			return a
		}
		if err := c.readOne(20 * time.Second); err != nil {
			c.t.Fatalf("waiting for the answer to %d: %v", id, err)
		}
	}
}

// call sends one request and waits for its answer.
func (c *rawConn) call(id uint32, op string, args any) answer {
	c.t.Helper()
	c.sendJSON(protocol.Request{ID: id, Op: op, Args: args})
	return c.await(id)
}

// pingID is the id ping uses: far from the ids tests pick.
const pingID = 4_000_000_000

// ping proves the connection still serves requests.
func (c *rawConn) ping() {
	c.t.Helper()
	if got := c.call(pingID, "ping", nil); got.Error != nil || string(got.Result) != "{}" {
		c.t.Fatalf("ping: %s", got)
	}
}

// assertAlive proves the broker still serves: a fresh dataplane connection answers a ping, and a
// REST call works.
func assertAlive(t testing.TB, b *servertest.Broker, url, cred string) {
	t.Helper()
	c := dialRaw(t, url, cred)
	c.ping()
	c.ws.Close()
	if _, err := b.Client.ListAllSandboxes(context.Background(), client.ListOptions{}); err != nil {
		t.Fatalf("REST after the abuse: %v", err)
	}
}

// dpConnections reads the broker's open dataplane connection gauge.
func dpConnections(t testing.TB, b *servertest.Broker) int {
	t.Helper()
	resp, err := http.Get(b.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "sbx_dataplane_connections "); ok {
			n, _ := strconv.ParseFloat(v, 64)
			return int(n)
		}
	}
	t.Fatal("no sbx_dataplane_connections metric")
	return 0
}

func newSandbox(t testing.TB, b *servertest.Broker, name string) (id, url string) {
	t.Helper()
	res, err := b.Client.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	return res.Sandbox.ID, dataplaneURL(b, res.Sandbox.ID)
}

func TestDataplaneMalformedFrames(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "frames")
	key := b.Client.APIKey()
	c := dialRaw(t, url, key)
	cases := []struct {
		name  string
		frame string
		id    uint32
		code  string
	}{
		{"malformed JSON", `{"id":1,"op":`, 0, "invalid_json"},
		{"trailing garbage", `{"id":1,"op":"ping"} x`, 0, "invalid_json"},
		{"empty frame", ``, 0, "invalid_json"},
		{"array", `[1,2,3]`, 0, "invalid_json"},
		{"string", `"ping"`, 0, "invalid_json"},
		{"number", `42`, 0, "invalid_json"},
		{"null", `null`, 0, "invalid_json"},
		{"missing id", `{"op":"ping"}`, 0, "invalid_json"},
		{"null id", `{"id":null,"op":"ping"}`, 0, "invalid_json"},
		{"missing op", `{"id":5}`, 0, "invalid_json"},
		{"empty op", `{"id":5,"op":""}`, 0, "invalid_json"},
		{"op not a string", `{"id":5,"op":7}`, 0, "invalid_json"},
		{"id over uint32", `{"id":4294967296,"op":"ping"}`, 0, "invalid_json"},
		{"negative id", `{"id":-1,"op":"ping"}`, 0, "invalid_json"},
		{"fractional id", `{"id":1.5,"op":"ping"}`, 0, "invalid_json"},
		{"string id", `{"id":"7","op":"ping"}`, 0, "invalid_json"},
		{"huge id", `{"id":1e400,"op":"ping"}`, 0, "invalid_json"},
		// The envelope is well formed, so request 9 gets its one answer: its args are refused.
		{"deep nesting", `{"id":9,"op":"stat","args":` + strings.Repeat("[", 10000) + strings.Repeat("]", 10000) + `}`, 9, "invalid_argument"},
		{"deep nesting, other key order", `{"op":"stat","id":9,"args":` + strings.Repeat("[", 10001) + strings.Repeat("]", 10001) + `}`, 0, "invalid_json"},
		{"unknown op", `{"id":8,"op":"format_disk"}`, 8, "unknown_op"},
		{"cancel-like op", `{"id":8,"op":"Cancel"}`, 8, "unknown_op"},
		{"unknown arg", `{"id":10,"op":"stat","args":{"path":"a","bogus":1}}`, 10, "invalid_argument"},
		{"unknown arg on env", `{"id":11,"op":"env","args":{"x":1}}`, 11, "invalid_argument"},
		{"args not an object", `{"id":12,"op":"stat","args":[1]}`, 12, "invalid_argument"},
		{"args a string", `{"id":13,"op":"read","args":"a.txt"}`, 13, "invalid_argument"},
		{"path not a string", `{"id":14,"op":"stat","args":{"path":5}}`, 14, "invalid_argument"},
		{"argv not a list", `{"id":15,"op":"exec","args":{"argv":"ls"}}`, 15, "invalid_argument"},
		{"env not strings", `{"id":16,"op":"exec","args":{"command":"true","env":{"A":1}}}`, 16, "invalid_argument"},
		{"negative timeout", `{"id":17,"op":"exec","args":{"command":"true","timeout_ms":-1}}`, 17, "invalid_argument"},
		{"max_output too big", `{"id":18,"op":"exec","args":{"command":"true","max_output":1e12}}`, 18, "invalid_argument"},
		{"both command and argv", `{"id":19,"op":"exec","args":{"command":"true","argv":["true"]}}`, 19, "invalid_argument"},
		{"neither command nor argv", `{"id":20,"op":"exec","args":{}}`, 20, "invalid_argument"},
		{"offset overflow", `{"id":21,"op":"read","args":{"path":"a","offset":18446744073709551616}}`, 21, "invalid_argument"},
		{"bad regex", `{"id":22,"op":"grep","args":{"pattern":"(","regex":true}}`, 22, "invalid_argument"},
		{"cwd outside", `{"id":23,"op":"exec","args":{"command":"true","cwd":"/etc"}}`, 23, "invalid_path"},
	}
	for _, tc := range cases {
		c.sendText(tc.frame)
		got := c.await(tc.id)
		if got.code() != tc.code || got.Error.Message == "" {
			t.Errorf("%s: want id %d %s, got %s", tc.name, tc.id, tc.code, got)
		}
		if bytes.Contains([]byte(got.Error.Message), []byte(key)) {
			t.Errorf("%s: the error echoes the key", tc.name)
		}
		c.ping()
	}
	// Edge values: each gets an answer (a result or a refusal, never internal), and the request
	// goroutine must not panic, which would take the whole broker down.
	os.WriteFile(filepath.Join(b.DataDir, "sandboxes", c.hello.SandboxID, "workspace", "e.txt"), []byte("a\nb\n"), 0o644)
	edges := []string{
		`{"path":"e.txt","offset":9223372036854775807}`,
		`{"path":"e.txt","offset":9223372036854775807,"length":9223372036854775807}`,
		`{"path":"e.txt","length":9223372036854775807}`,
		`{"path":"e.txt","line_offset":9223372036854775807,"line_limit":9223372036854775807}`,
		`{"path":"e.txt","offset":-1}`,
		`{"path":"e.txt","line_limit":-5}`,
		`{"path":"e.txt","offset":1,"line_offset":1}`,
		`{"path":"/workspace"}`,
		`{"path":""}`,
	}
	var edgeReqs []string
	for _, a := range edges {
		edgeReqs = append(edgeReqs, `{"op":"read","args":`+a+`}`)
	}
	for _, r := range []string{
		`{"op":"glob","args":{"pattern":"` + strings.Repeat("*/", 63) + `*"}}`,
		`{"op":"glob","args":{"pattern":"` + strings.Repeat("**/", 100) + `x"}}`,
		`{"op":"glob","args":{"pattern":"` + strings.Repeat("a/", 200) + `"}}`,
		`{"op":"glob","args":{"pattern":"["}}`,
		`{"op":"glob","args":{"pattern":"[]"}}`,
		`{"op":"glob","args":{"pattern":"[^"}}`,
		`{"op":"glob","args":{"pattern":"\\"}}`,
		`{"op":"glob","args":{"pattern":""}}`,
		`{"op":"grep","args":{"pattern":""}}`,
		`{"op":"grep","args":{"pattern":"a","glob":"["}}`,
		`{"op":"grep","args":{"pattern":"a","max_count":-1}}`,
		`{"op":"grep","args":{"pattern":"a","max_count":9223372036854775807}}`,
		`{"op":"grep","args":{"pattern":"(a*)*b","regex":true}}`,
		`{"op":"grep","args":{"pattern":"` + strings.Repeat("(", 2000) + `","regex":true}}`,
		`{"op":"grep","args":{"pattern":"a{1000}{1000}","regex":true}}`,
		`{"op":"edit","args":{"path":"e.txt","old":"","new":"x"}}`,
		`{"op":"edit","args":{"path":"e.txt","old":"a","new":"a"}}`,
		`{"op":"write","args":{"path":"w.txt","content":"!!!","encoding":"base64"}}`,
		`{"op":"write","args":{"path":"w.txt","content":"x","encoding":"utf-16"}}`,
		`{"op":"write","args":{"path":"w.txt","content":"x","mode":"append"}}`,
		`{"op":"write","args":{"path":"/workspace","content":"x"}}`,
		`{"op":"write","args":{"path":"e.txt/x","content":"x"}}`,
		`{"op":"upload","args":{"path":"u.txt","mode":"sideways"}}`,
		`{"op":"mkdir","args":{"path":"/workspace"}}`,
		`{"op":"delete","args":{"path":"/workspace","recursive":true}}`,
		`{"op":"delete","args":{"path":"."}}`,
		`{"op":"move","args":{"from":"/workspace","to":"x"}}`,
		`{"op":"move","args":{"from":"e.txt","to":"/workspace"}}`,
		`{"op":"move","args":{"from":"e.txt","to":"e.txt"}}`,
		`{"op":"move","args":{"from":".","to":"sub/inside"}}`,
		`{"op":"ls","args":{"path":"e.txt"}}`,
		`{"op":"exec","args":{"argv":[""]}}`,
		`{"op":"exec","args":{"argv":["true",""]}}`,
		`{"op":"exec","args":{"command":"true","env":{"A=B":"c"}}}`,
		`{"op":"exec","args":{"command":"true","env":{"":"c"}}}`,
		`{"op":"exec","args":{"command":"true","env":{"A":"c\u0000d"}}}`,
		`{"op":"exec","args":{"command":"echo a\u0000b"}}`,
		`{"op":"exec","args":{"argv":["echo","a\u0000b"]}}`,
		`{"op":"exec","args":{"command":"true","timeout_ms":9223372036854775807}}`,
		`{"op":"exec","args":{"command":"true","max_output":67108864}}`,
		`{"op":"exec","args":{"command":"true","cwd":""}}`,
		`{"op":"exec","args":{"command":"true","background":true,"stream":true}}`,
		`{"op":"env","args":null}`,
		`{"op":"ping","args":{"anything":1}}`,
	} {
		edgeReqs = append(edgeReqs, r)
	}
	for i, r := range edgeReqs {
		id := uint32(500 + i)
		c.sendText(`{"id":` + strconv.Itoa(int(id)) + `,` + r[1:])
		got := c.await(id)
		if got.code() == "internal" {
			t.Errorf("%.120s: %s", r, got)
		}
		c.ping()
	}

	// Text frames must be UTF-8: invalid bytes are refused, never turned into U+FFFD (which would
	// name another file).
	for _, frame := range [][]byte{
		[]byte("{\"id\":30,\"op\":\"write\",\"args\":{\"path\":\"a\xff.txt\",\"content\":\"x\"}}"),
		{0xff, 0xfe, 0xfd},
		[]byte("{\"id\":31,\"op\":\"ping\"}\xc0"),
	} {
		if err := c.ws.WriteMessage(websocket.TextMessage, frame); err != nil {
			t.Fatal(err)
		}
		if got := c.await(0); got.code() != "invalid_json" {
			t.Errorf("invalid UTF-8 %q: %s", frame, got)
		}
		c.ping()
	}
	if got := c.answers[30]; len(got) > 0 {
		t.Errorf("a frame with invalid UTF-8 was executed: %v", got)
	}
	// Only the file the test made, unchanged: none of the refused frames wrote anything.
	if tree := treeSnapshot(t, filepath.Join(b.DataDir, "sandboxes", c.hello.SandboxID, "workspace")); len(tree) != 2 || tree["e.txt"] != "-rw-r--r-- a\nb\n" {
		t.Errorf("malformed frames changed the workspace: %q", tree)
	}
	// Nothing was left unanswered or answered twice.
	c.ping()
	for id, list := range c.answers {
		if len(list) > 0 {
			t.Errorf("unexpected extra answers for %d: %v", id, list)
		}
	}
	assertAlive(t, b, url, key)
}

func TestDataplaneOversizedFrames(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "big")
	key := b.Client.APIKey()
	bystander := dialRaw(t, url, key)
	for _, tc := range []struct {
		name string
		kind int
		size int
	}{
		{"text", websocket.TextMessage, 0},
		{"binary", websocket.BinaryMessage, 0},
		{"text, far over", websocket.TextMessage, 64 << 20},
		{"with a body", websocket.BinaryMessage, -1},
	} {
		c := dialRaw(t, url, key)
		limit := c.hello.Limits.MaxFrameBytes
		if limit != 1<<20+64<<10 {
			t.Errorf("max_frame_bytes %d", limit)
		}
		size := tc.size
		if size == 0 {
			size = limit + 1
		}
		var frame []byte
		switch {
		case tc.size < 0:
			js := `{"id":1,"op":"write","args":{"path":"big.txt"}}`
			frame = bodyFrame(1, js, bytes.Repeat([]byte{'a'}, limit+1-protocol.BodyHeaderLen-len(js)))
		case tc.kind == websocket.TextMessage:
			frame = []byte(`{"id":1,"op":"read","args":{"path":"big.txt","x":"` + strings.Repeat("a", size) + `"}}`)
		default:
			frame = dataFrame(protocol.FrameData, 1, bytes.Repeat([]byte{'a'}, size))
		}
		// The server may close before the whole frame is written; a write error is fine.
		go c.ws.WriteMessage(tc.kind, frame)
		var ce *websocket.CloseError
		for {
			if err := c.readOne(10 * time.Second); err != nil {
				if !errors.As(err, &ce) {
					t.Fatalf("%s: ended by %v, want a close frame", tc.name, err)
				}
				break
			}
		}
		if ce.Code != websocket.CloseMessageTooBig {
			t.Errorf("%s: close %d %q, want 1009", tc.name, ce.Code, ce.Text)
		}
		bystander.ping()
	}
	// A frame of exactly max_frame_bytes is fine.
	c := dialRaw(t, url, key)
	limit := c.hello.Limits.MaxFrameBytes
	js := `{"id":2,"op":"write","args":{"path":"fits.txt"}}`
	c.sendBinary(bodyFrame(2, js, bytes.Repeat([]byte{'b'}, limit-protocol.BodyHeaderLen-len(js))))
	if got := c.await(2); got.Error != nil {
		t.Errorf("a frame of exactly max_frame_bytes: %s", got)
	}
	if _, err := os.Stat(filepath.Join(b.DataDir, "sandboxes", c.hello.SandboxID, "workspace", "big.txt")); err == nil {
		t.Error("an oversized frame's write happened")
	}
	assertAlive(t, b, url, key)
}

func TestDataplaneStrayBinaryFrames(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "binary")
	ws := workspaceDir(b, id)
	key := b.Client.APIKey()
	c := dialRaw(t, url, key)

	for _, n := range []int{0, 1, 4} {
		c.sendBinary(make([]byte, n))
		if got := c.await(0); got.code() != "invalid_argument" {
			t.Errorf("%d-byte binary frame: %s", n, got)
		}
	}
	for _, kind := range []byte{protocol.FrameStdout, protocol.FrameStderr, protocol.FrameData, protocol.FrameEnd, 0, 9, 255} {
		c.sendBinary(dataFrame(kind, 77, []byte("payload")))
		// Stray frames are answered on id 0: the id they name may belong to a request in flight.
		if got := c.await(0); got.code() != "invalid_argument" || !strings.Contains(got.Error.Message, "request 77") {
			t.Errorf("kind %d for an unknown id: %s", kind, got)
		}
	}
	c.ping()

	// An upload, then a data frame and an end frame after its end.
	c.sendJSON(protocol.Request{ID: 5, Op: "upload", Args: map[string]any{"path": "up.txt"}})
	c.sendBinary(dataFrame(protocol.FrameData, 5, []byte("hello ")))
	c.sendBinary(dataFrame(protocol.FrameData, 5, []byte("world")))
	c.sendBinary(dataFrame(protocol.FrameEnd, 5, nil))
	var wr protocol.WriteResult
	if got := c.await(5); got.Error != nil || got.decode(&wr) != nil || wr.Size != 11 || !wr.Created {
		t.Fatalf("upload: %s", got)
	}
	c.sendBinary(dataFrame(protocol.FrameData, 5, []byte(" and more")))
	if got := c.await(0); got.code() != "invalid_argument" {
		t.Errorf("data after the end: %s", got)
	}
	c.sendBinary(dataFrame(protocol.FrameEnd, 5, nil))
	if got := c.await(0); got.code() != "invalid_argument" {
		t.Errorf("a second end: %s", got)
	}
	if data, _ := os.ReadFile(filepath.Join(ws, "up.txt")); string(data) != "hello world" {
		t.Errorf("upload content %q", data)
	}

	// Frames of the wrong kind for an upload in progress do not disturb it.
	c.sendJSON(protocol.Request{ID: 6, Op: "upload", Args: map[string]any{"path": "up2.txt"}})
	c.sendBinary(dataFrame(protocol.FrameData, 6, []byte("one ")))
	c.sendBinary(dataFrame(protocol.FrameStdout, 6, []byte("not data")))
	if got := c.await(0); got.code() != "invalid_argument" {
		t.Errorf("stdout frame for an upload: %s", got)
	}
	c.sendBinary(dataFrame(protocol.FrameData, 6, []byte("two")))
	c.sendBinary(dataFrame(protocol.FrameEnd, 6, nil))
	if got := c.await(6); got.Error != nil {
		t.Errorf("upload after a stray frame: %s", got)
	}
	if data, _ := os.ReadFile(filepath.Join(ws, "up2.txt")); string(data) != "one two" {
		t.Errorf("upload content %q", data)
	}

	// An end frame for a request that is not an upload is refused (on id 0) and otherwise ignored:
	// the request still completes with its one result.
	c.sendJSON(protocol.Request{ID: 7, Op: "exec", Args: map[string]any{"command": "sleep 0.3; echo done"}})
	c.sendBinary(dataFrame(protocol.FrameEnd, 7, nil))
	c.sendBinary(dataFrame(protocol.FrameData, 7, []byte("x")))
	stray := []answer{c.await(0), c.await(0)}
	for _, got := range stray {
		if got.code() != "invalid_argument" {
			t.Errorf("binary frame for an exec in flight: %s", got)
		}
	}
	var er protocol.ExecResult
	if got := c.await(7); got.Error != nil || got.decode(&er) != nil || er.Output == nil && er.Stdout == nil {
		t.Errorf("exec after stray frames: %s", got)
	} else if out := *er.Stdout; out != "done\n" {
		t.Errorf("exec output %q", out)
	}
	entries, _ := os.ReadDir(ws)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"up.txt", "up2.txt"}) {
		t.Errorf("workspace holds %v", names)
	}
	assertAlive(t, b, url, key)
}

func TestDataplaneInflightLimits(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "inflight")
	key := b.Client.APIKey()
	c := dialRaw(t, url, key)

	// A duplicate id in flight is refused; the first request is not disturbed.
	c.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": "sleep 0.3; echo first"}})
	c.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": "echo second > second.txt"}})
	// Refused on id 0, so that request 1 still has exactly one answer.
	if got := c.await(0); got.code() != "invalid_argument" || !strings.Contains(got.Error.Message, "id 1 is already in flight") {
		t.Errorf("duplicate id: %s", got)
	}
	var er protocol.ExecResult
	if got := c.await(1); got.Error != nil || got.decode(&er) != nil || *er.Stdout != "first\n" {
		t.Errorf("first request: %s", got)
	}
	if _, err := os.Stat(filepath.Join(workspaceDir(b, id), "second.txt")); err == nil {
		t.Error("the duplicate ran")
	}
	// Reuse after the answer is fine.
	if got := c.call(1, "ping", nil); got.Error != nil {
		t.Errorf("reuse: %s", got)
	}

	// 70 slow requests at once: max_inflight run, the rest are refused at once and start nothing.
	max := c.hello.Limits.MaxInflight
	if max != 64 {
		t.Errorf("max_inflight %d", max)
	}
	const n = 70
	start := time.Now()
	for i := 0; i < n; i++ {
		c.sendJSON(protocol.Request{ID: uint32(100 + i), Op: "exec", Args: map[string]any{"argv": []string{"sh", "-c", fmt.Sprintf("sleep 1; touch ran-%d", i)}}})
	}
	var ok, refused int
	for i := 0; i < n; i++ {
		got := c.await(uint32(100 + i))
		switch got.code() {
		case "":
			ok++
		case "too_many_requests":
			refused++
			if _, err := os.Stat(filepath.Join(workspaceDir(b, id), fmt.Sprintf("ran-%d", i))); err == nil {
				t.Errorf("refused request %d ran", i)
			}
		default:
			t.Errorf("request %d: %s", i, got)
		}
	}
	if ok != max || refused != n-max {
		t.Errorf("%d ran and %d were refused, want %d and %d", ok, refused, max, n-max)
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Errorf("70 one-second requests took %s", took)
	}
	// The slots are free again.
	for i := 0; i < max; i++ {
		c.sendJSON(protocol.Request{ID: uint32(1000 + i), Op: "stat", Args: map[string]any{"path": "/workspace"}})
	}
	for i := 0; i < max; i++ {
		if got := c.await(uint32(1000 + i)); got.Error != nil {
			t.Errorf("stat %d after the burst: %s", i, got)
		}
	}
	assertAlive(t, b, url, key)
}

// An id may be reused as soon as its answer has arrived (docs/dataplane.md §2), however fast the
// client is.
func TestDataplaneIDReuseRightAfterAnswer(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "reuse")
	c := dialRaw(t, url, b.Client.APIKey())
	// Keep max_inflight-1 requests in flight so that a slot released late is also seen, as a
	// too_many_requests.
	max := c.hello.Limits.MaxInflight
	for i := 0; i < max-1; i++ {
		c.sendJSON(protocol.Request{ID: uint32(10 + i), Op: "exec", Args: map[string]any{"command": "sleep 3"}})
	}
	bad := 0
	deadline := time.Now().Add(2 * time.Second)
	n := 0
	for ; time.Now().Before(deadline); n++ {
		got := c.call(1, "stat", map[string]any{"path": "/workspace"})
		if got.Error != nil {
			bad++
			if bad <= 3 {
				t.Errorf("round %d: reusing id 1 right after its answer: %s", n, got)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d reuses refused", bad, n)
	}
}

// Path attacks over the raw protocol, with symlinks planted from inside a namespace sandbox: a
// secret outside the workspace never comes back in any frame, and nothing outside changes.
func TestDataplanePathAttacks(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	id, url := newSandbox(t, b, "paths")
	ws := workspaceDir(b, id)
	key := b.Client.APIKey()
	// The secret sits three levels above the workspace: <data>/secret.txt next to <data>/sandboxes.
	const secret = "TOP-SECRET-d1f0a2b9"
	secretPath := filepath.Join(b.DataDir, "secret.txt")
	if err := os.WriteFile(secretPath, []byte(secret+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	hostDir := filepath.Join(b.DataDir, "hostdir")
	if err := os.Mkdir(hostDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hostDir, "inner.txt"), []byte(secret+" inner\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, url, key)
	c.all = &bytes.Buffer{}
	// Planted from inside the sandbox, as an agent would; again before each attack that may
	// change the tree, so that every attack meets the links.
	plant := strings.Join([]string{
		"cd /workspace && rm -rf etc up secretlink hostlink sub abslink chain viaup stolen ok.txt",
		"ln -s /etc etc",
		"ln -s ../../.. up",
		"ln -s ../../../secret.txt secretlink",
		"ln -s ../../../hostdir hostlink",
		"mkdir sub && ln -s ../../../../secret.txt sub/deep",
		"ln -s /workspace/../../../secret.txt abslink",
		"ln -s secretlink chain",
		"ln -s up/hostdir viaup",
		"echo harmless > ok.txt",
	}, " && ")
	planted := 0
	replant := func() {
		t.Helper()
		planted++
		var er protocol.ExecResult
		if got := c.call(1, "exec", map[string]any{"command": plant}); got.Error != nil || got.decode(&er) != nil || er.ExitCode != 0 {
			t.Fatalf("planting links: %s %+v", got, er)
		}
	}
	replant()
	hostBefore := treeSnapshot(t, hostDir)
	etcPasswd, _ := os.ReadFile("/etc/passwd")
	long := "/workspace/" + strings.Repeat("a", 5000)

	// Paths refused whatever the op: they leave the workspace lexically or are malformed...
	lexical := []string{
		"../secret.txt", "/workspace/../../../secret.txt", "../../../../../../etc/passwd",
		"/etc/passwd", "/", "//etc/passwd", secretPath, "/workspacex/secret.txt",
		"a\x00b", "/workspace/ok.txt\x00/etc/passwd", long,
	}
	// ... or go through a link that leads out.
	throughLinks := []string{
		"etc/passwd", "/workspace/etc/passwd", "etc/shadow",
		"up/secret.txt", "up/hostdir/inner.txt", "hostlink/inner.txt", "viaup/inner.txt",
		"sub/deep/x", "chain/x",
	}
	// Links that lead out, as the last component: an lstat, deleting or renaming the link itself
	// is fine; following it is invalid_path. A stat of "etc/" or "up/." follows the link, as
	// stat(2) does, so it is refused too.
	links := []string{"secretlink", "sub/deep", "abslink", "chain", "hostlink", "etc", "up", "viaup", "etc/", "up/."}

	type attack struct {
		op    string
		args  map[string]any
		codes []string // the acceptable answers; "" is success
	}
	invalid := []string{"invalid_path"}
	var attacks []attack
	for _, p := range append(lexical, throughLinks...) {
		attacks = append(attacks,
			attack{"stat", map[string]any{"path": p}, invalid},
			attack{"ls", map[string]any{"path": p}, invalid},
			attack{"read", map[string]any{"path": p}, invalid},
			attack{"download", map[string]any{"path": p}, invalid},
			attack{"write", map[string]any{"path": p, "content": "pwned"}, invalid},
			attack{"edit", map[string]any{"path": p, "old": "TOP", "new": "pwned"}, invalid},
			attack{"delete", map[string]any{"path": p, "recursive": true}, invalid},
			attack{"mkdir", map[string]any{"path": p, "parents": true}, invalid},
			attack{"move", map[string]any{"from": p, "to": "stolen"}, invalid},
			attack{"move", map[string]any{"from": "ok.txt", "to": p, "overwrite": true}, invalid},
			attack{"upload", map[string]any{"path": p}, invalid},
			attack{"glob", map[string]any{"pattern": "*", "path": p}, invalid},
			// A pattern is not a path: a NUL or an overlong one is a bad argument.
			attack{"glob", map[string]any{"pattern": p}, []string{"invalid_path", "invalid_argument"}},
			attack{"grep", map[string]any{"pattern": "SECRET", "path": p}, invalid},
			attack{"grep", map[string]any{"pattern": "root", "path": p}, invalid},
		)
	}
	// An exec's cwd is checked lexically; inside the sandbox it may follow links (they resolve in
	// the sandbox's own file system, not the host's).
	for _, p := range lexical {
		attacks = append(attacks, attack{"exec", map[string]any{"command": "true", "cwd": p}, invalid})
	}
	for _, p := range links {
		// A path ending in / or /. names a directory: a write or an upload is refused for that
		// first (is_directory), before the link is looked at.
		writeCodes := invalid
		if strings.HasSuffix(p, "/") || strings.HasSuffix(p, "/.") {
			writeCodes = append(slices.Clip(invalid), "is_directory")
		}
		// A delete or a move of such a path is refused too: one ending in /. (invalid_path) is
		// never acted on under its cleaned name, and a link is not the directory a trailing /
		// names (not_directory). Either changes nothing; without them the link itself goes.
		moveOntoCodes := []string{"", "invalid_path"}
		if strings.HasSuffix(p, "/") {
			moveOntoCodes = []string{"not_directory"}
		}
		removeCodes, statCodes := []string{""}, []string{""}
		if strings.HasSuffix(p, "/") || strings.HasSuffix(p, "/.") {
			statCodes = invalid
		}
		switch {
		case strings.HasSuffix(p, "/."):
			removeCodes = invalid
		case strings.HasSuffix(p, "/"):
			removeCodes = []string{"not_directory"}
		}
		attacks = append(attacks,
			attack{"stat", map[string]any{"path": p}, statCodes},
			attack{"ls", map[string]any{"path": p}, invalid},
			attack{"read", map[string]any{"path": p}, invalid},
			attack{"download", map[string]any{"path": p}, invalid},
			attack{"write", map[string]any{"path": p, "content": "pwned"}, writeCodes},
			attack{"edit", map[string]any{"path": p, "old": "TOP", "new": "pwned"}, invalid},
			attack{"delete", map[string]any{"path": p}, removeCodes},
			attack{"delete", map[string]any{"path": p, "recursive": true}, removeCodes},
			attack{"mkdir", map[string]any{"path": p}, []string{"invalid_path", "file_exists"}},
			attack{"mkdir", map[string]any{"path": p, "parents": true}, []string{"invalid_path", "file_exists"}},
			attack{"move", map[string]any{"from": p, "to": "stolen"}, removeCodes},
			// Renaming onto a link replaces the link, never its target; a file renamed onto a
			// name ending in / is not_directory (rename(2)'s ENOTDIR), and nothing changes.
			attack{"move", map[string]any{"from": "ok.txt", "to": p, "overwrite": true}, moveOntoCodes},
			attack{"upload", map[string]any{"path": p}, writeCodes},
			attack{"glob", map[string]any{"pattern": "*", "path": p}, invalid},
			attack{"glob", map[string]any{"pattern": p}, []string{""}},
			attack{"grep", map[string]any{"pattern": "SECRET", "path": p}, invalid},
		)
	}
	// Searches from the top do not follow the links out.
	for _, a := range []map[string]any{
		{"pattern": "**"}, {"pattern": "**/*.txt"}, {"pattern": "*/*"}, {"pattern": "**/inner.txt"},
	} {
		attacks = append(attacks, attack{"glob", a, []string{""}})
	}
	attacks = append(attacks,
		attack{"glob", map[string]any{"pattern": "../*"}, []string{"invalid_path", "invalid_argument"}},
		attack{"grep", map[string]any{"pattern": "SECRET"}, []string{""}},
		attack{"grep", map[string]any{"pattern": "root:"}, []string{""}},
		attack{"grep", map[string]any{"pattern": "SECRET", "glob": "**"}, []string{""}},
		attack{"grep", map[string]any{"pattern": "S.CRET", "regex": true, "glob": "*.txt"}, []string{""}},
	)

	mutating := map[string]bool{"write": true, "edit": true, "delete": true, "mkdir": true, "move": true, "upload": true}
	reqID := uint32(100)
	for _, a := range attacks {
		reqID++
		if mutating[a.op] {
			replant()
		}
		var got answer
		if a.op == "upload" {
			c.sendJSON(protocol.Request{ID: reqID, Op: "upload", Args: a.args})
			c.sendBinary(dataFrame(protocol.FrameData, reqID, []byte("pwned")))
			c.sendBinary(dataFrame(protocol.FrameEnd, reqID, nil))
			got = c.await(reqID)
			// A refused upload's data and end frames are answered as strays.
			if got.Error != nil {
				for i := 0; i < 2; i++ {
					if stray := c.await(0); stray.code() != "invalid_argument" {
						t.Errorf("upload %.80q: stray frame answer %s", a.args, stray)
					}
				}
			}
		} else {
			got = c.call(reqID, a.op, a.args)
		}
		if !slices.Contains(a.codes, got.code()) {
			t.Errorf("%s %.100q: want one of %q, got %s", a.op, a.args, a.codes, got)
		}
		if a.op == "stat" && got.Error == nil {
			var fi protocol.FileInfo
			if got.decode(&fi) != nil || fi.Type != "symlink" {
				t.Errorf("stat %q: want the link itself, got %s", a.args["path"], got)
			}
		}
		for _, bin := range got.bin {
			if bytes.Contains(bin, []byte(secret)) {
				t.Errorf("%s %q: the secret came in a binary frame", a.op, a.args)
			}
		}
	}
	c.ping()
	t.Logf("%d attacks, links planted %d times", len(attacks), planted)
	if bytes.Contains(c.all.Bytes(), []byte(secret)) {
		t.Errorf("the secret appeared in a frame")
	}
	if len(etcPasswd) > 0 && bytes.Contains(c.all.Bytes(), etcPasswd[:min(len(etcPasswd), 40)]) {
		t.Errorf("the host's /etc/passwd appeared in a frame")
	}
	if data, err := os.ReadFile(secretPath); err != nil || string(data) != secret+"\n" {
		t.Errorf("the secret file changed: %q %v", data, err)
	}
	sameTree(t, "host dir", hostBefore, treeSnapshot(t, hostDir))
	if data, _ := os.ReadFile("/etc/passwd"); !bytes.Equal(data, etcPasswd) {
		t.Error("/etc/passwd changed")
	}
	for _, p := range []string{filepath.Join(b.DataDir, "stolen"), filepath.Join(b.DataDir, "pwned"), filepath.Join(b.DataDir, "sandboxes", "stolen")} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s appeared outside the workspace", p)
		}
	}
	// No temporary file of a refused write or upload is left behind.
	filepath.WalkDir(ws, func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.Contains(d.Name(), "tmp") {
			t.Errorf("left behind: %s", p)
		}
		return nil
	})
	assertAlive(t, b, url, key)
}

// heapInuse is the broker's (this process's) heap in use, after a GC.
func heapInuse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// A client that sends requests as fast as it can and never reads an answer blocks only itself:
// the broker stops reading it, its memory stays bounded, other connections are served meanwhile,
// and everything is released when the client goes.
func TestDataplaneFloodWithoutReading(t *testing.T) {
	// Not parallel: it measures this process's heap and another connection's latency.
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "flood")
	os.WriteFile(filepath.Join(workspaceDir(b, id), "f.txt"), []byte("x"), 0o644)
	key := b.Client.APIKey()
	bystander := dialRaw(t, url, key)
	bystander.ping()
	baseConns := dpConnections(t, b)
	baseHeap := heapInuse()
	baseGoroutines := runtime.NumGoroutine()

	flood := dialRaw(t, url, key)
	var sent atomic.Int64
	floodDone := make(chan error, 1)
	go func() {
		// Pre-encoded frames, one write each: pings (answered on the reader) and stats (answered
		// from a goroutine per request, bounded by max_inflight).
		var frames [2][]byte
		until := time.Now().Add(4 * time.Second)
		flood.ws.SetWriteDeadline(until)
		for i := uint32(1); time.Now().Before(until) && i <= 1_000_000; i++ {
			frames[0] = []byte(`{"id":` + strconv.FormatUint(uint64(i), 10) + `,"op":"ping"}`)
			frames[1] = []byte(`{"id":` + strconv.FormatUint(uint64(i), 10) + `,"op":"stat","args":{"path":"f.txt"}}`)
			if err := flood.ws.WriteMessage(websocket.TextMessage, frames[i%2]); err != nil {
				floodDone <- err
				return
			}
			sent.Add(1)
		}
		floodDone <- nil
	}()

	// Meanwhile (until the flooder stops) the bystander is served, and the heap stays bounded.
	var lat []time.Duration
	var peak uint64
	var err error
	tick := time.NewTicker(5 * time.Millisecond) // a ping every 5 ms: a latency sample, not a wait
	defer tick.Stop()
sample:
	for {
		start := time.Now()
		bystander.ping()
		lat = append(lat, time.Since(start))
		if len(lat)%50 == 0 {
			var m runtime.MemStats
			runtime.ReadMemStats(&m)
			peak = max(peak, m.HeapInuse)
		}
		select {
		case err = <-floodDone:
			break sample
		case <-tick.C:
		}
	}
	peak = max(peak, heapInuse())
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	p50, p99 := lat[len(lat)/2], lat[len(lat)*99/100]
	t.Logf("flood: %d frames sent (stopped by %v); bystander ping p50 %s p99 %s over %d; heap %d MiB -> peak %d MiB",
		sent.Load(), err, p50, p99, len(lat), baseHeap>>20, peak>>20)
	if sent.Load() < 10_000 {
		t.Errorf("only %d frames went out: the broker did not read them", sent.Load())
	}
	if p50 > 50*time.Millisecond {
		t.Errorf("bystander ping p50 %s during the flood", p50)
	}
	if peak > baseHeap+200<<20 {
		t.Errorf("heap grew from %d MiB to %d MiB during the flood", baseHeap>>20, peak>>20)
	}
	if n := dpConnections(t, b); n != baseConns+1 {
		t.Errorf("%d connections during the flood, want %d", n, baseConns+1)
	}

	// The abusive client goes; everything it held is released.
	flood.ws.Close()
	if !wait.Until(5*time.Second, func() bool { return dpConnections(t, b) == baseConns }) {
		t.Errorf("%d connections 5s after the flooder left, want %d", dpConnections(t, b), baseConns)
	}
	if !wait.Until(5*time.Second, func() bool { return runtime.NumGoroutine() <= baseGoroutines+5 }) {
		t.Errorf("%d goroutines after the flooder left, %d before", runtime.NumGoroutine(), baseGoroutines)
	}
	if h := heapInuse(); h > baseHeap+32<<20 {
		t.Errorf("heap %d MiB after the flooder left, %d MiB before", h>>20, baseHeap>>20)
	}
	bystander.ping()
	assertAlive(t, b, url, key)
}

// A download to a client that never reads holds a bounded amount of memory, and is released when
// the client goes.
func TestDataplaneDownloadNeverRead(t *testing.T) {
	// Not parallel: it measures this process's heap.
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "slowdl")
	key := b.Client.APIKey()
	// 256 MiB, sparse: cheap to make, and far more than any buffer on the way.
	f, err := os.Create(filepath.Join(workspaceDir(b, id), "huge.bin"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(256 << 20)
	f.Close()
	bystander := dialRaw(t, url, key)
	baseConns := dpConnections(t, b)
	baseHeap := heapInuse()

	var slow []*rawConn
	for i := 0; i < 3; i++ {
		c := dialRaw(t, url, key)
		c.sendJSON(protocol.Request{ID: 1, Op: "download", Args: map[string]any{"path": "huge.bin"}})
		slow = append(slow, c)
	}
	// The downloads have gone as far as they will once their queues are full (4 MiB each, less the
	// chunk that waits for room); from then on the heap must not grow: a second of watching is
	// many times what reading another chunk of the file into memory takes.
	wait.Eventually(t, 20*time.Second, func() bool { return server.Usage(b.Server).QueuedBytes >= 3*3<<20 },
		"the three unread downloads' queues full")
	var peak uint64
	wait.Never(t, time.Second, func() bool {
		bystander.ping()
		peak = max(peak, heapInuse())
		return peak > baseHeap+200<<20
	}, "3 unread downloads grew the heap by over 200 MiB")
	t.Logf("3 unread downloads: heap %d MiB -> peak %d MiB", baseHeap>>20, peak>>20)
	// Each connection may hold its write queue of 1 MiB chunks; not the file.
	if peak > baseHeap+200<<20 {
		t.Errorf("heap grew from %d MiB to %d MiB", baseHeap>>20, peak>>20)
	}
	for _, c := range slow {
		c.ws.Close()
	}
	if !wait.Until(5*time.Second, func() bool { return dpConnections(t, b) == baseConns }) {
		t.Errorf("%d connections after the readers left, want %d", dpConnections(t, b), baseConns)
	}
	if h := heapInuse(); h > baseHeap+32<<20 {
		t.Errorf("heap %d MiB after the readers left, %d MiB before", h>>20, baseHeap>>20)
	}
	assertAlive(t, b, url, key)
}

func TestDataplaneCancel(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "cancel")
	ws := workspaceDir(b, id)
	key := b.Client.APIKey()
	c := dialRaw(t, url, key)

	// An exec's whole process tree dies: a shell, a child in the background, a grandchild.
	tree := `sleep 300 & echo $! > child.pid; sh -c 'sleep 300 & echo $! > grandchild.pid; wait' & echo $$ > shell.pid; wait`
	c.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": tree}})
	if !wait.Until(5*time.Second, func() bool {
		for _, f := range []string{"child.pid", "grandchild.pid", "shell.pid"} {
			if data, _ := os.ReadFile(filepath.Join(ws, f)); !bytes.HasSuffix(data, []byte("\n")) {
				return false
			}
		}
		return true
	}) {
		t.Fatal("the process tree did not start")
	}
	var pids []string
	for _, f := range []string{"child.pid", "grandchild.pid", "shell.pid"} {
		data, _ := os.ReadFile(filepath.Join(ws, f))
		pids = append(pids, strings.TrimSpace(string(data)))
	}
	start := time.Now()
	c.sendJSON(protocol.Request{ID: 1, Op: "cancel"})
	if got := c.await(1); got.code() != "cancelled" {
		t.Errorf("cancelled exec: %s", got)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("cancel took %s", took)
	}
	// A second exec looks for them: gone, or zombies waiting for the reaper.
	check := `for p in ` + strings.Join(pids, " ") + `; do s=$(sed -n 's/^State:\t\(.\).*/\1/p' /proc/$p/status 2>/dev/null); [ -z "$s" ] || [ "$s" = Z ] || echo "$p alive ($s)"; done`
	alive := ""
	wait.Until(3*time.Second, func() bool {
		got := c.call(2, "exec", map[string]any{"command": check})
		var er protocol.ExecResult
		if got.Error != nil || got.decode(&er) != nil {
			t.Fatalf("check exec: %s", got)
		}
		alive = *er.Stdout
		return alive == ""
	})
	if alive != "" {
		t.Errorf("after the cancel: %s", alive)
	}

	// A cancelled upload leaves the target untouched, and no temporary file.
	if err := os.WriteFile(filepath.Join(ws, "keep.txt"), []byte("original"), 0o640); err != nil {
		t.Fatal(err)
	}
	before := treeSnapshot(t, ws)
	c.sendJSON(protocol.Request{ID: 3, Op: "upload", Args: map[string]any{"path": "keep.txt"}})
	c.sendBinary(dataFrame(protocol.FrameData, 3, bytes.Repeat([]byte("replacement "), 50000)))
	c.sendJSON(protocol.Request{ID: 3, Op: "cancel"})
	if got := c.await(3); got.code() != "cancelled" {
		t.Errorf("cancelled upload: %s", got)
	}
	// Frames that were still on the way are strays now, and change nothing.
	c.sendBinary(dataFrame(protocol.FrameData, 3, []byte("late")))
	c.sendBinary(dataFrame(protocol.FrameEnd, 3, nil))
	for i := 0; i < 2; i++ {
		if got := c.await(0); got.code() != "invalid_argument" {
			t.Errorf("frame after the cancel: %s", got)
		}
	}
	sameTree(t, "cancelled upload", before, treeSnapshot(t, ws))

	// A cancel of an unknown id, of a finished one, and of id 0 do nothing: no answer, no harm.
	c.sendJSON(protocol.Request{ID: 12345, Op: "cancel"})
	c.sendJSON(protocol.Request{ID: 2, Op: "cancel"})
	c.sendJSON(protocol.Request{ID: 0, Op: "cancel"})
	c.ping()
	for id, list := range c.answers {
		if len(list) > 0 {
			t.Errorf("a cancel was answered: id %d %v", id, list)
		}
	}
	sameTree(t, "cancel of unknown ids", before, treeSnapshot(t, ws))

	// Cancelling a streamed exec mid-output stops the stream.
	c.sendJSON(protocol.Request{ID: 4, Op: "exec", Args: map[string]any{"command": "yes", "stream": true, "max_output": 64 << 20}})
	for len(c.bins[4]) < 3 {
		if err := c.readOne(10 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	c.sendJSON(protocol.Request{ID: 4, Op: "cancel"})
	if got := c.await(4); got.code() != "cancelled" {
		t.Errorf("cancelled stream: %s", got)
	}
	c.ping()
	if n := len(c.bins[4]); n > 0 {
		t.Errorf("%d stream frames after the answer", n)
	}

	// A client that goes away mid-upload leaves neither targets nor temporary files.
	before = treeSnapshot(t, ws)
	conns := dpConnections(t, b)
	quitter := dialRaw(t, url, key)
	for i := 0; i < 10; i++ {
		id := uint32(10 + i)
		quitter.sendJSON(protocol.Request{ID: id, Op: "upload", Args: map[string]any{"path": fmt.Sprintf("gone/%d.txt", i)}})
		quitter.sendBinary(dataFrame(protocol.FrameData, id, []byte("partial")))
	}
	quitter.ping()
	quitter.ws.Close()
	if !wait.Until(5*time.Second, func() bool { return dpConnections(t, b) == conns }) {
		t.Errorf("the quitter's connection is still counted")
	}
	after := treeSnapshot(t, ws)
	for k := range after {
		if strings.HasPrefix(k, "gone/") {
			t.Errorf("an abandoned upload left %s", k)
		}
	}
	delete(after, "gone") // the parent directory an upload creates may stay
	sameTree(t, "abandoned uploads", before, after)
	assertAlive(t, b, url, key)
}

// 50 goroutines share one backend.Remote with mixed operations; each checks its own results.
func TestDataplaneRemoteConcurrency(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "concurrent")
	r, err := backend.Dial(t.Context(), backend.Config{URL: url, Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := t.Context()
	var wg sync.WaitGroup
	errs := make(chan error, 1000)
	for g := 0; g < 50; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fail := func(format string, args ...any) {
				errs <- fmt.Errorf("goroutine %d: "+format, append([]any{g}, args...)...)
			}
			name := fmt.Sprintf("g%02d/file.txt", g)
			for round := 0; round < 4; round++ {
				content := fmt.Sprintf("goroutine %d round %d\n", g, round)
				if _, err := r.Write(ctx, protocol.WriteArgs{Path: name, Content: content}); err != nil {
					fail("write: %v", err)
					return
				}
				rr, err := r.Read(ctx, protocol.ReadArgs{Path: name})
				if err != nil || rr.Content != content || rr.Path != "/workspace/"+name {
					fail("read: %v %q %q", err, rr.Content, rr.Path)
				}
				fi, err := r.Stat(ctx, name)
				if err != nil || fi.Size != int64(len(content)) || fi.Path != "/workspace/"+name {
					fail("stat: %v %+v", err, fi)
				}
				res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: fmt.Sprintf("echo %d-%d; cat %s", g, round, name)}})
				if err != nil || res.Stdout == nil || *res.Stdout != fmt.Sprintf("%d-%d\n%s", g, round, content) {
					fail("exec: %v %+v", err, res)
				}
				var out bytes.Buffer
				if _, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: fmt.Sprintf("seq %d %d", g*1000, g*1000+500)}, Stdout: &out}); err != nil {
					fail("stream: %v", err)
				} else if want := seq(g*1000, g*1000+500); out.String() != want {
					fail("stream: got %d bytes, want %d", out.Len(), len(want))
				}
				blob := bytes.Repeat([]byte{byte(g), byte(round)}, 70000+g*1000)
				bin := fmt.Sprintf("g%02d/blob.bin", g)
				if w, err := r.Upload(ctx, bin, bytes.NewReader(blob)); err != nil || w.Size != int64(len(blob)) {
					fail("upload: %v %+v", err, w)
				}
				var got bytes.Buffer
				if n, err := r.Download(ctx, bin, &got); err != nil || n != int64(len(blob)) || !bytes.Equal(got.Bytes(), blob) {
					fail("download: %v %d", err, n)
				}
				gr, err := r.Grep(ctx, protocol.GrepArgs{Pattern: fmt.Sprintf("goroutine %d round", g), Path: fmt.Sprintf("g%02d", g)})
				if err != nil || len(gr.Matches) != 1 || gr.Matches[0].Path != "/workspace/"+name {
					fail("grep: %v %+v", err, gr)
				}
				if _, err := r.Read(ctx, protocol.ReadArgs{Path: fmt.Sprintf("g%02d/missing", g)}); code(err) != protocol.CodeFileNotFound {
					fail("read of a missing file: %v", err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func seq(from, to int) string {
	var sb strings.Builder
	for i := from; i <= to; i++ {
		sb.WriteString(strconv.Itoa(i))
		sb.WriteByte('\n')
	}
	return sb.String()
}

// The Go backend takes every answer the broker sends: reads answer up to 8 MiB of content in one
// text frame (docs/dataplane.md §3), bigger than a chunk.
func TestDataplaneRemoteLargeAnswers(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "large")
	ws := workspaceDir(b, id)
	r, err := backend.Dial(t.Context(), backend.Config{URL: url, Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := t.Context()
	text := bytes.Repeat([]byte("0123456789abcde\n"), 9<<20/16) // 9 MiB: over the 8 MiB cap
	if err := os.WriteFile(filepath.Join(ws, "big.txt"), text, 0o644); err != nil {
		t.Fatal(err)
	}
	rr, err := r.Read(ctx, protocol.ReadArgs{Path: "big.txt"})
	if err != nil || !rr.Truncated || len(rr.Content) != 8<<20 {
		t.Errorf("read of a 9 MiB file: %v truncated=%v %d bytes", err, rr.Truncated, len(rr.Content))
	}
	binary := bytes.Repeat([]byte{0xff, 0x00, 0x01}, 3<<20/3) // 3 MiB, base64 in the answer
	os.WriteFile(filepath.Join(ws, "big.bin"), binary, 0o644)
	rr, err = r.Read(ctx, protocol.ReadArgs{Path: "big.bin"})
	if err != nil || rr.Encoding != "base64" || rr.Size != int64(len(binary)) {
		t.Errorf("read of a 3 MiB binary file: %v %s %d", err, rr.Encoding, rr.Size)
	}
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "head -c 3000000 /dev/zero | tr '\\0' '\\1'", MaxOutput: 4 << 20}})
	if err != nil || res.Stdout == nil || len(*res.Stdout) != 3000000 {
		t.Errorf("exec with 3 MB of control bytes (18 MB of JSON): %v", err)
	}
	if err := r.Ping(ctx); err != nil {
		t.Errorf("ping after the large answers: %v", err)
	}
}

// Paths the Go backend cannot carry in JSON are refused before they are sent: encoding would turn
// invalid UTF-8 into U+FFFD and name another file.
func TestDataplaneRemoteInvalidUTF8Paths(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	id, url := newSandbox(t, b, "utf8")
	ws := workspaceDir(b, id)
	r, err := backend.Dial(t.Context(), backend.Config{URL: url, Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := t.Context()
	os.WriteFile(filepath.Join(ws, "a\uFFFD.txt"), []byte("the other file"), 0o644)
	bad := "a\xff.txt"
	if _, err := r.Upload(ctx, bad, strings.NewReader("upload")); code(err) != protocol.CodeInvalidPath {
		t.Errorf("upload: %v", err)
	}
	var out bytes.Buffer
	if _, err := r.Download(ctx, bad, &out); code(err) != protocol.CodeInvalidPath || out.Len() != 0 {
		t.Errorf("download: %v %q", err, out.String())
	}
	if data, _ := os.ReadFile(filepath.Join(ws, "a\uFFFD.txt")); string(data) != "the other file" {
		t.Errorf("another file was written: %q", data)
	}
}

// A cancelled streaming call returns, and the backend writes nothing more into the caller's
// writer after that (run with -race).
func TestDataplaneRemoteCancelledStream(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "stream")
	r, err := backend.Dial(t.Context(), backend.Config{URL: url, Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for i := 0; i < 10; i++ {
		ctx, cancel := context.WithTimeout(t.Context(), time.Duration(20+10*i)*time.Millisecond)
		var out bytes.Buffer
		_, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "yes", MaxOutput: 64 << 20}, Stdout: &out})
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("round %d: %v", i, err)
		}
		n := out.Len()
		// A barrier: the broker writes the exec event once the command's output is all queued,
		// and the connection is ordered, so once a ping sent after that event is answered, the
		// client's reader has handled every chunk the broker sent for the cancelled call.
		wait.Eventually(t, 10*time.Second, func() bool {
			n := 0
			for _, e := range sandboxEvents(t, b.Client, "stream") {
				if e.Type == protocol.EventExec && e.Command == "yes" {
					n++
				}
			}
			return n > i
		}, "round %d: the cancelled exec's event", i)
		if err := r.Ping(t.Context()); err != nil {
			t.Fatalf("round %d: ping: %v", i, err)
		}
		if out.Len() != n {
			t.Errorf("round %d: the writer grew from %d to %d bytes after Exec returned", i, n, out.Len())
		}
	}
	if err := r.Ping(t.Context()); err != nil {
		t.Errorf("ping: %v", err)
	}
}
