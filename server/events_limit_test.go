package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// One API key holds at most EventStreamsPerKey followed event streams open on a broker; past it a
// stream is 429 too_many_connections with Retry-After, and a closed one frees its slot. Each stream
// is a connection and a file descriptor: one key opened them without bound at its request rate
// (1,140 in 15 s on a real broker), enough to take the broker's descriptors from every org.
func TestEventStreamsPerKeyAreBounded(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{EventStreamsPerKey: 3})
	key := b.Client.APIKey()
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "watched"}); err != nil {
		t.Fatal(err)
	}
	get := func(ctx context.Context, path, key string) *http.Response {
		req, _ := http.NewRequestWithContext(ctx, "GET", b.URL+path, nil)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	// open starts a followed stream and returns what ends it.
	open := func(path, key string) context.CancelFunc {
		ctx, cancel := context.WithCancel(t.Context())
		resp := get(ctx, path, key)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d", path, resp.StatusCode)
		}
		if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil { // retry: the stream is served
			t.Fatal(err)
		}
		t.Cleanup(func() { cancel(); resp.Body.Close() })
		return func() { cancel(); resp.Body.Close() }
	}
	first := open("/v1/events", key)
	open("/v1/sandboxes/watched/events", key)
	open("/v1/events", key)

	for _, path := range []string{"/v1/events", "/v1/sandboxes/watched/events"} {
		ctx, cancel := context.WithCancel(t.Context())
		resp := get(ctx, path, key)
		if resp.StatusCode != 429 {
			cancel()
			t.Fatalf("%s past the cap: status %d, want 429", path, resp.StatusCode)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		var eb protocol.ErrorBody
		json.Unmarshal(body, &eb)
		if resp.StatusCode != 429 || eb.Error.Code != "too_many_connections" || resp.Header.Get("Retry-After") == "" || !strings.Contains(eb.Error.Message, "3 event streams") {
			t.Fatalf("%s past the cap: %d %s (Retry-After %q)", path, resp.StatusCode, body, resp.Header.Get("Retry-After"))
		}
		if strings.Contains(string(body), key) {
			t.Fatal("the answer echoes the API key")
		}
	}
	// What is not a followed stream, and another key of the same org, are not held back.
	if resp := get(t.Context(), "/v1/events?follow=false", key); resp.StatusCode != 200 {
		t.Fatalf("follow=false at the cap: %d", resp.StatusCode)
	} else {
		resp.Body.Close()
	}
	other, _ := keyClient(t, b)
	open("/v1/events", other.APIKey())

	// A closed stream gives its slot back.
	first()
	if !wait.Until(10*time.Second, func() bool {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		resp := get(ctx, "/v1/events", key)
		resp.Body.Close()
		return resp.StatusCode == 200
	}) {
		t.Fatal("a stream was refused after one of the key's streams closed")
	}
}
