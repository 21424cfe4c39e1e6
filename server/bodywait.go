package server

import (
	"errors"
	"io"
	"net/http"
	"os"
	"time"

	"github.com/labstack/echo/v4"
)

// bodyWait bounds how long a request's body may take to arrive, from the request's start to its
// last byte: 1 MiB (maxBody) in 30 s is 35 KB/s. Without it a client that promises a body and
// stops sending holds its connection and a goroutine for as long as it likes: the handler waits
// in its read, and when the handler did not read the body (a refusal: no credentials, a rate limit)
// the HTTP server reads what is left before it reuses the connection, with no deadline either, so
// a source with no credentials at all could hold the broker's descriptors. The upload route
// (dataplane_put.go) sets its own, an idle rule, once it reads its body.
const bodyWait = 30 * time.Second

// boundBody sets the body wait on requests that carry a body, and lifts it once the body has been
// read to its end: what the handler then does (a create that waits for its sandbox, an MCP tool
// call that runs for minutes) is not bounded by it. Requests without a body (reads, event streams,
// dataplane upgrades) are left alone.
func (s *Server) boundBody(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		r := c.Request()
		if r.ContentLength == 0 || r.Body == nil || r.Body == http.NoBody {
			return next(c)
		}
		rc := http.NewResponseController(c.Response())
		if err := rc.SetReadDeadline(time.Now().Add(s.bodyWait)); err != nil {
			return next(c) // not a connection that takes deadlines (a test's recorder)
		}
		c.Set(ctxBodyWait, s.bodyWait)
		r.Body = &boundedBody{ReadCloser: r.Body, lift: func() { rc.SetReadDeadline(time.Time{}) }}
		return next(c)
	}
}

// boundedBody lifts its connection's read deadline once the body has been read to its end.
type boundedBody struct {
	io.ReadCloser
	lift func()
}

func (b *boundedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && b.lift != nil {
		b.lift()
		b.lift = nil
	}
	return n, err
}

// bodyLate says whether err is a body's read cut by the body wait.
func bodyLate(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }
