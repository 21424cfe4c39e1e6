package server_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// Every GET route answers HEAD with the GET's status and headers and no body: a load balancer's
// HEAD health check, `curl -I`. A HEAD on an event stream ends at once (it never holds a stream
// open), a HEAD on the dataplane never upgrades, and the MCP endpoint refuses HEAD (405).
func TestHeadAnswersLikeGet(t *testing.T) {
	t.Parallel()
	spec, err := servertest.LoadSpec()
	if err != nil {
		t.Fatal(err)
	}
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	sb, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "head"})
	if err != nil {
		t.Fatal(err)
	}
	key, _, err := b.Store.CreateAPIKey(ctx, b.Org, "head", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	do := func(method, path string, hdr http.Header) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, method, b.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if hdr != nil {
			req.Header = hdr.Clone()
		}
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, body
	}
	for _, op := range spec.Operations() {
		method, path, _ := strings.Cut(op, " ")
		if method != http.MethodGet {
			continue
		}
		path = strings.NewReplacer("{ref}", sb.Sandbox.ID).Replace(path)
		getPath := path
		if strings.HasSuffix(path, "/events") {
			getPath += "?follow=false" // the GET must end; the HEAD must end without being told
		}
		get, _ := do(http.MethodGet, getPath, nil)
		head, body := do(http.MethodHead, path, nil)
		if strings.HasSuffix(path, "/mcp") {
			if head.StatusCode != http.StatusMethodNotAllowed {
				t.Errorf("HEAD %s: %d, want 405", path, head.StatusCode)
			}
			continue
		}
		if head.StatusCode != get.StatusCode || head.Header.Get("Content-Type") != get.Header.Get("Content-Type") {
			t.Errorf("HEAD %s: %d %q, GET: %d %q", path, head.StatusCode, head.Header.Get("Content-Type"), get.StatusCode, get.Header.Get("Content-Type"))
		}
		if len(body) != 0 {
			t.Errorf("HEAD %s: a body of %d bytes", path, len(body))
		}
		if err := spec.CheckResponse(http.MethodHead, path, head.StatusCode, head.Header.Get("Content-Type"), body); err != nil {
			t.Errorf("HEAD %s: %v", path, err)
		}
	}
	// A HEAD on a followed stream holds nothing: on one connection, the next request is answered.
	one := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
	defer one.CloseIdleConnections()
	for _, path := range []string{"/v1/events", "/v1/sandboxes/" + sb.Sandbox.ID + "/events", "/healthz"} {
		guard, cancel := context.WithTimeout(ctx, 30*time.Second) // fails the test instead of hanging it
		req, _ := http.NewRequestWithContext(guard, http.MethodHead, b.URL+path+"?follow=true", nil)
		if path == "/healthz" {
			req, _ = http.NewRequestWithContext(guard, http.MethodGet, b.URL+path, nil)
		}
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := one.Do(req)
		cancel()
		if err != nil {
			t.Fatalf("%s %s after HEADs on event streams: %v", req.Method, path, err)
		}
		resp.Body.Close()
	}
	// A HEAD offering everything a dataplane upgrade needs still does not upgrade.
	ws := http.Header{"Connection": {"Upgrade"}, "Upgrade": {"websocket"}, "Sec-Websocket-Version": {"13"},
		"Sec-Websocket-Key": {"dGhlIHNhbXBsZSBub25jZQ=="}, "Sec-Websocket-Protocol": {protocol.Subprotocol}}
	head, _ := do(http.MethodHead, "/v1/sandboxes/"+sb.Sandbox.ID+"/dataplane", ws)
	if head.StatusCode != http.StatusBadRequest {
		t.Errorf("HEAD with a WebSocket handshake on the dataplane: %d, want 400", head.StatusCode)
	}
}
