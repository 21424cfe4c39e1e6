package server_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/server/servertest"
)

// lockedBuffer collects a broker's logs for a test to read.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// requestSeries counts the sbx_http_requests_total series /metrics reports, and returns the
// longest line of the exposition.
func requestSeries(t *testing.T, url string) (int, int) {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	n, longest := 0, 0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "sbx_http_requests_total{") {
			n++
		}
		longest = max(longest, len(sc.Text()))
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return n, longest
}

// rawMethod sends one request with any method name and path (net/http's client refuses some of
// them), without credentials, and returns the status line's code.
func rawMethod(t *testing.T, addr, method, path string) int {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", method, path)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// Method names and paths are the caller's to choose, without credentials: neither may become a
// metric series (each one is kept for the life of the process) or an unbounded log line.
func TestUnknownMethodsAndRoutesAreBounded(t *testing.T) {
	t.Parallel()
	logs := &lockedBuffer{}
	b := servertest.New(t, servertest.Options{Log: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	addr := strings.TrimPrefix(b.URL, "http://")
	b.Client.ListSandboxes(t.Context(), client.ListOptions{})
	send := func(i int) {
		big := strings.Repeat("M", 64<<10) + fmt.Sprint(i)
		for _, r := range []struct{ method, path string }{
			{big, "/v1/sandboxes"},
			{big, "/v1/nope"},
			{"GET", "/v1/" + strings.Repeat("p", 64<<10) + fmt.Sprint(i)},
			{fmt.Sprintf("BREW%d", i), "/v1/sandboxes/sb_x/stop"},
		} {
			if st := rawMethod(t, addr, r.method, r.path); st < 400 || st >= 500 {
				t.Fatalf("%.20s %.40s: status %d, want a 4xx", r.method, r.path, st)
			}
		}
	}
	send(0)
	requestSeries(t, b.URL) // the scrape's own series, from here on
	before, _ := requestSeries(t, b.URL)
	for i := 1; i <= 20; i++ {
		send(i)
	}
	after, longest := requestSeries(t, b.URL)
	if after != before {
		t.Errorf("unknown methods and routes grew the request metric from %d to %d series", before, after)
	}
	if longest > 1024 {
		t.Errorf("a /metrics line is %d bytes long: a caller's method or path became a label", longest)
	}
	for _, line := range strings.Split(logs.String(), "\n") {
		if len(line) > 2048 {
			t.Fatalf("a log line is %d bytes long: %.200s", len(line), line)
		}
	}
	if !strings.Contains(logs.String(), `"method":"MMMM`) {
		t.Errorf("the access log no longer names unknown methods at all:\n%.2000s", logs.String())
	}
}
