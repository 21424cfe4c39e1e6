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

// StdioTransport is the SDK's newline-delimited stdio transport on in and out, with one change:
// a line that is not JSON gets a JSON-RPC parse error (id null) and is dropped, where the SDK would
// end the session; an over-long line gets an invalid-request error.
func StdioTransport(in io.Reader, out io.Writer) sdk.Transport {
	w := &lockedWriter{w: out}
	return &sdk.IOTransport{Reader: &lineFilter{r: bufio.NewReaderSize(in, 64<<10), w: w}, Writer: w}
}

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (l *lockedWriter) Close() error { return nil }

// lineFilter passes whole lines that are JSON and answers the others.
type lineFilter struct {
	r       *bufio.Reader
	w       *lockedWriter
	pending []byte
}

func (f *lineFilter) Close() error { return nil }

func (f *lineFilter) Read(p []byte) (int, error) {
	for len(f.pending) == 0 {
		line, tooLong, err := f.readLine()
		if len(line) > 0 || tooLong {
			trimmed := bytes.TrimSpace(line)
			switch {
			case tooLong:
				f.refuse(jsonrpc.CodeInvalidRequest, fmt.Sprintf("the message is over %d bytes, this server's limit", MaxStdioLine))
			case len(trimmed) == 0:
			case !json.Valid(trimmed):
				f.refuse(jsonrpc.CodeParseError, "the message is not valid JSON")
			default:
				f.pending = append(trimmed, '\n')
			}
		}
		if err != nil && len(f.pending) == 0 {
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

func (f *lineFilter) refuse(code int64, msg string) {
	b, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": nil, "error": map[string]any{"code": code, "message": msg}})
	f.w.Write(append(b, '\n'))
}
