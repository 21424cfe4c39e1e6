package mcp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"sync"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// MaxStdioLine bounds one message on stdio; a longer line is refused with a JSON-RPC error.
const MaxStdioLine = 16 << 20

// StdioTransport is the SDK's newline-delimited stdio transport on in and out, with two changes:
// a line that is not JSON gets a JSON-RPC parse error (id null) and is dropped, where the SDK would
// end the session (an over-long line gets an invalid-request error); and the end of in ends the
// session only once every request read has been answered, where the SDK would drop them, so that
// a client that writes its requests and closes its end (a pipe, a script) gets every answer.
func StdioTransport(in io.Reader, out io.Writer) sdk.Transport {
	open := &openRequests{ids: map[string]bool{}, closed: make(chan struct{})}
	w := &lockedWriter{w: out, open: open}
	return &sdk.IOTransport{Reader: &lineFilter{r: bufio.NewReaderSize(in, 64<<10), w: w, open: open}, Writer: w}
}

type lockedWriter struct {
	mu   sync.Mutex
	w    io.Writer
	open *openRequests
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n, err := l.w.Write(p)
	if id, ok := answerID(p); ok {
		l.open.answered(id)
	}
	return n, err
}

func (l *lockedWriter) Close() error { return nil }

// openRequests are the ids of the requests read and not answered yet. A set: a client that reuses
// an id in flight gets no wait for the second, rather than a wait for an answer that never comes.
type openRequests struct {
	mu     sync.Mutex
	ids    map[string]bool
	none   chan struct{} // closed when ids empties, for a reader waiting at the end of its input
	closed chan struct{} // closed with the transport: nobody waits any more
	once   sync.Once
}

func (o *openRequests) read(id string) {
	o.mu.Lock()
	o.ids[id] = true
	o.mu.Unlock()
}

func (o *openRequests) answered(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.ids, id)
	if len(o.ids) == 0 && o.none != nil {
		close(o.none)
		o.none = nil
	}
}

// wait returns once every request read is answered, or the transport is closed.
func (o *openRequests) wait() {
	o.mu.Lock()
	if len(o.ids) == 0 {
		o.mu.Unlock()
		return
	}
	if o.none == nil {
		o.none = make(chan struct{})
	}
	none := o.none
	o.mu.Unlock()
	select {
	case <-none:
	case <-o.closed:
	}
}

// answerID is the id a response (a message with an id and no method) answers.
func answerID(msg []byte) (string, bool) {
	m, err := jsonrpc.DecodeMessage(bytes.TrimSpace(msg))
	if r, ok := m.(*jsonrpc.Response); err == nil && ok {
		return idKey(r.ID)
	}
	return "", false
}

// idKey names a JSON-RPC id as the SDK decoded it (an int64 or a string: 3, 3.0 and 3.5 are all
// answered as 3); a null id is no request's. Both sides of the count decode with the SDK's own
// decoder, so that they agree on every spelling the SDK takes (exact-case keys, its depth limit):
// a message this transport read as a request and the SDK as a notification would be waited for
// forever.
func idKey(id jsonrpc.ID) (string, bool) {
	switch v := id.Raw().(type) {
	case string:
		return "s:" + v, true
	case int64:
		return fmt.Sprintf("n:%d", v), true
	}
	return "", false
}

// rawID is the id to refuse a message with: its exact-case "id" if that is a string or a number,
// else none (id null).
func rawID(msg []byte) json.RawMessage {
	var keys map[string]json.RawMessage
	if json.Unmarshal(msg, &keys) != nil {
		return nil
	}
	var v any
	if json.Unmarshal(keys["id"], &v) != nil {
		return nil
	}
	switch v.(type) {
	case string, float64:
		return keys["id"]
	}
	return nil
}

// cancelled is the request a notifications/cancelled names, read with exact-case keys as the SDK
// reads it.
func cancelled(params json.RawMessage) (jsonrpc.ID, bool) {
	var p map[string]json.RawMessage
	if json.Unmarshal(params, &p) != nil {
		return jsonrpc.ID{}, false
	}
	var v any
	if json.Unmarshal(p["requestId"], &v) != nil {
		return jsonrpc.ID{}, false
	}
	id, err := jsonrpc.MakeID(v)
	return id, err == nil && id.IsValid()
}

// lineFilter passes whole lines that are JSON and answers the others.
type lineFilter struct {
	r       *bufio.Reader
	w       *lockedWriter
	open    *openRequests
	pending []byte
}

func (f *lineFilter) Close() error {
	f.open.once.Do(func() { close(f.open.closed) })
	return nil
}

func (f *lineFilter) Read(p []byte) (int, error) {
	for len(f.pending) == 0 {
		line, tooLong, err := f.readLine()
		if len(line) > 0 || tooLong {
			trimmed := bytes.TrimSpace(line)
			switch {
			case tooLong:
				f.refuse(nil, jsonrpc.CodeInvalidRequest, fmt.Sprintf("the message is over %d bytes, this server's limit", MaxStdioLine))
			case len(trimmed) == 0:
			case !json.Valid(trimmed):
				f.refuse(nil, jsonrpc.CodeParseError, "the message is not valid JSON")
			case trimmed[0] != '{':
				f.refuse(nil, jsonrpc.CodeInvalidRequest, "a message is one JSON object on a line (no batches)")
			default:
				// Decoded by the SDK's own decoder: what it cannot decode (an id that is an object,
				// no "jsonrpc":"2.0", a "JSONRPC" key, a method that is no string, nesting past its
				// depth limit) would end its session, so it is refused here on its own.
				m, err := jsonrpc.DecodeMessage(trimmed)
				if err != nil {
					why := "the message is not a JSON-RPC 2.0 request, notification or response: " + clip(err.Error())
					var v struct {
						Version *string `json:"jsonrpc"`
					}
					if json.Unmarshal(trimmed, &v); v.Version == nil || *v.Version != "2.0" {
						why = `the message is not JSON-RPC 2.0: give "jsonrpc":"2.0"`
					}
					f.refuse(rawID(trimmed), jsonrpc.CodeInvalidRequest, why)
					continue
				}
				if r, ok := m.(*jsonrpc.Request); ok {
					if id, ok := idKey(r.ID); ok {
						f.open.read(id)
					} else if id, ok := cancelled(r.Params); ok && r.Method == "notifications/cancelled" {
						if key, ok := idKey(id); ok {
							f.open.answered(key) // a cancelled request may get no answer
						}
					}
				}
				f.pending = append(trimmed, '\n')
			}
		}
		if err != nil && len(f.pending) == 0 {
			f.open.wait()
			return 0, err
		}
		if err != nil {
			break
		}
	}
	n := copy(p, f.pending)
	f.pending = f.pending[n:]
	return n, nil
}

// readLine reads one line (without its newline), discarding the rest of one over MaxStdioLine.
func (f *lineFilter) readLine() (line []byte, tooLong bool, err error) {
	for {
		chunk, err := f.r.ReadSlice('\n')
		if !tooLong {
			if len(line)+len(chunk) > MaxStdioLine+1 {
				tooLong, line = true, nil
			} else {
				line = append(line, chunk...)
			}
		}
		if err == bufio.ErrBufferFull {
			continue
		}
		return bytes.TrimSuffix(line, []byte("\n")), tooLong, err
	}
}

// refuse answers a message the SDK must not see with a JSON-RPC error: of its id when it has one
// (a string or a number), else of id null.
func (f *lineFilter) refuse(id json.RawMessage, code int64, msg string) {
	var answer any
	if len(id) > 0 {
		answer = id
	}
	type rpcError struct {
		Code    int64  `json:"code"`
		Message string `json:"message"`
	}
	b, _ := json.Marshal(struct {
		JSONRPC string   `json:"jsonrpc"`
		ID      any      `json:"id"`
		Error   rpcError `json:"error"`
	}{"2.0", answer, rpcError{code, msg}})
	f.w.Write(append(b, '\n'))
}

// clip bounds a decoder's complaint, which may quote the value it refused, in an answer.
func clip(s string) string {
	if len(s) > 200 {
		return strings.ToValidUTF8(s[:200], "") + "..."
	}
	return s
}
