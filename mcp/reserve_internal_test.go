package mcp

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// headerSpy records what the token's open sessions counted when the answer's header was written.
type headerSpy struct {
	*httptest.ResponseRecorder
	h          *HTTP
	jti        string
	openAtHead int
}

func (s *headerSpy) WriteHeader(code int) {
	s.h.mu.Lock()
	s.openAtHead = s.h.open[s.jti]
	s.h.mu.Unlock()
	s.ResponseRecorder.WriteHeader(code)
}

func (s *headerSpy) Write(p []byte) (int, error) {
	if !s.ResponseRecorder.Flushed && s.ResponseRecorder.Code == 200 && s.openAtHead < 0 {
		s.WriteHeader(200)
	}
	return s.ResponseRecorder.Write(p)
}

// A request that opens no session gives its place among the token's sessions back before its
// answer leaves, not after: the SDK's client sends server/discover and then, on its answer,
// initialize, which found the discover's place still taken under a load that delayed the
// handler's return, and with one session a token was refused its first (429 too_many_connections).
func TestARequestOpeningNoSessionFreesItsPlaceBeforeItsAnswer(t *testing.T) {
	h := NewHTTP(HTTPConfig{MaxSessionsPerToken: 1, Open: nil})
	id := Identity{Token: "t", JTI: "jti-1", SandboxID: "sb", ExpiresAt: time.Now().Add(time.Hour)}
	for _, body := range []string{
		`{"jsonrpc":"2.0","id":1,"method":"server/discover","params":{}}`,
		`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`,
		`not json`,
	} {
		req := httptest.NewRequest(http.MethodPost, "/mcp", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer t")
		req = req.WithContext(WithIdentity(req.Context(), id))
		spy := &headerSpy{ResponseRecorder: httptest.NewRecorder(), h: h, jti: id.JTI, openAtHead: -1}
		if err := h.Serve(spy, req); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if spy.Header().Get("Mcp-Session-Id") != "" {
			t.Fatalf("%s opened a session (%d)", body, spy.Code)
		}
		if spy.openAtHead != 0 {
			t.Errorf("%s, which opened no session (%d), still held its place when its answer was written", body, spy.Code)
		}
	}
}
