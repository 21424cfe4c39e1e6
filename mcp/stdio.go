package mcp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
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

// stdioMessage is what the transport reads of a message: its id, method, and for a cancellation
// the request it cancels.
type stdioMessage struct {
	Version *string         `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Method  string          `json:"method"`
	Params  struct {
		RequestID json.RawMessage `json:"requestId"`
	} `json:"params"`
}

// answerID is the id a response (a message with an id and no method) answers.
func answerID(msg []byte) (string, bool) {
	var m struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
	}
	if json.Unmarshal(bytes.TrimSpace(msg), &m) != nil || m.Method != "" {
		return "", false
	}
	return idKey(m.ID)
}

// idKey names a JSON-RPC id as the SDK answers it: a string as itself, a number as its integer
// part (3, 3.0 and 3.5 are answered as 3); an absent or null id is no request's.
func idKey(raw json.RawMessage) (string, bool) {
	var v any
	if len(raw) == 0 || json.Unmarshal(raw, &v) != nil {
		return "", false
	}
	switch v := v.(type) {
	case string:
		return "s:" + v, true
	case float64:
		return fmt.Sprintf("n:%d", int64(v)), true
	}
	return "", false
}

// validID reports whether raw is absent or an id the SDK takes (a string, a number or null): any
// other ends the SDK's session.
func validID(raw json.RawMessage) bool {
	var v any
	if len(raw) == 0 || json.Unmarshal(raw, &v) != nil {
		return len(raw) == 0
	}
	switch v.(type) {
	case nil, string, float64:
		return true
	}
	return false
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
				var m stdioMessage
				json.Unmarshal(trimmed, &m)
				// Each of these would end the SDK's session: refused here, the session goes on.
				if !validID(m.ID) {
					f.refuse(nil, jsonrpc.CodeInvalidRequest, "the message's id is not a string, a number or null")
					continue
				}
				if m.Version != nil && *m.Version != "2.0" || m.Version == nil && (m.Method != "" || len(m.ID) > 0) {
					f.refuse(m.ID, jsonrpc.CodeInvalidRequest, `the message is not JSON-RPC 2.0: give "jsonrpc":"2.0"`)
					continue
				}
				if id, ok := idKey(m.ID); ok && m.Method != "" {
					f.open.read(id)
				}
				if id, ok := idKey(m.Params.RequestID); ok && m.Method == "notifications/cancelled" {
					f.open.answered(id) // a cancelled request may get no answer
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
	if _, ok := idKey(id); ok {
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
