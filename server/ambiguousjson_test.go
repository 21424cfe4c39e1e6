package server_test

import (
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// A body that says two things is refused, not read as its last word: encoding/json keeps the last
// of a repeated key and matches field names case-insensitively (with Unicode folding: "ſ" is "s"),
// where a proxy or policy check in front of the broker may read the first, or only the exact name.
// A mint body checked as {"scopes":["fs:read"]} there would otherwise mint exec here.
func TestAmbiguousJSONIsRefused(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	key := b.Client.APIKey()
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, path, body string }{
		{"repeated scopes", "/v1/sandboxes/dev/delegations", `{"scopes":["fs:read"],"scopes":["exec"]}`},
		{"scopes in another case", "/v1/sandboxes/dev/delegations", `{"scopes":["fs:read"],"SCOPES":["exec"]}`},
		{"scopes by Unicode folding", "/v1/sandboxes/dev/delegations", `{"ſcopes":["exec"]}`},
		{"repeated ttl", "/v1/sandboxes/dev/delegations", `{"scopes":["fs:read"],"ttl_seconds":60,"ttl_seconds":86400}`},
		{"repeated name", "/v1/sandboxes", `{"name":"one","name":"two"}`},
		{"name in another case", "/v1/sandboxes", `{"Name":"three"}`},
		{"repeated tag", "/v1/sandboxes", `{"name":"four","tags":{"k":"1","k":"2"}}`},
		{"repeated lease", "/v1/sandboxes/dev/ttl", `{"ttl_seconds":60,"ttl_seconds":1}`},
		{"repeated refs", "/v1/heartbeats", `{"refs":["dev"],"refs":["nosuch"]}`},
		{"repeated token", "/v1/tokens/introspect", `{"token":"a.b.c","Token":"d.e.f"}`},
		// encoding/json reads bytes that are not UTF-8 as U+FFFD: what is stored is not what was sent.
		{"a tag that is not UTF-8", "/v1/sandboxes", "{\"name\":\"five\",\"tags\":{\"k\":\"a\xffb\"}}"},
		// The same by escape: a lone surrogate names no character, and is read as U+FFFD too.
		{"a tag with a lone surrogate", "/v1/sandboxes", `{"name":"six","tags":{"k":"a\ud800b"}}`},
		{"a tag with a lone low surrogate", "/v1/sandboxes", `{"name":"seven","tags":{"k":"\uDC00"}}`},
		{"a tag with a surrogate pair reversed", "/v1/sandboxes", `{"name":"eight","tags":{"k":"\udc00\ud800"}}`},
	} {
		before := b.RedisSnapshot()
		status, eb, raw := rawRequest(t, "POST", b.URL+tc.path, key, tc.body)
		if status != 400 || eb.Error.Code != protocol.CodeInvalidJSON || !strings.Contains(eb.Error.Message, "twice") && !strings.Contains(eb.Error.Message, "case") && !strings.Contains(eb.Error.Message, "UTF-8") {
			t.Errorf("%s: %d %.300s, want 400 invalid_json saying what is wrong", tc.name, status, raw)
		}
		if after := b.RedisSnapshot(); !maps.Equal(before, after) {
			t.Errorf("%s: a refused request changed Redis", tc.name)
		}
	}
	// A character past U+FFFF given by its surrogate pair, escaped or not, and an escaped
	// backslash before what reads as an escape, are taken as sent.
	for _, tc := range []struct{ name, body, want string }{
		{"pair", `{"name":"pair","tags":{"k":"\ud83d\ude00"}}`, "\U0001F600"},
		{"backslash", `{"name":"backslash","tags":{"k":"\\ud800"}}`, `\ud800`},
	} {
		status, _, raw := rawRequest(t, "POST", b.URL+"/v1/sandboxes", key, tc.body)
		if status != 201 && status != 200 {
			t.Fatalf("%s: %d %.300s", tc.name, status, raw)
		}
		got, err := b.Client.GetSandbox(t.Context(), tc.name)
		if err != nil || got.Tags["k"] != tc.want {
			t.Fatalf("%s: %v %q, want %q", tc.name, err, got.Tags["k"], tc.want)
		}
	}
	// Tag keys are case-sensitive: "env" and "ENV" are two tags, not one said twice.
	res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "tagged", Tags: map[string]string{"env": "a", "ENV": "b"}})
	if err != nil || res.Sandbox.Tags["env"] != "a" || res.Sandbox.Tags["ENV"] != "b" {
		t.Fatalf("tags differing in case: %v %+v", err, res)
	}
}

// "allow_cmd": [] names no program: the token it asks for may run nothing, so it is refused (say
// which programs, or omit allow_cmd for any), never minted as a token that runs everything.
func TestEmptyAllowlistIsRefused(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	before := b.RedisSnapshot()
	status, eb, raw := rawRequest(t, "POST", b.URL+"/v1/sandboxes/dev/delegations", b.Client.APIKey(), `{"scopes":["exec"],"allow_cmd":[]}`)
	if status != 400 || eb.Error.Code != protocol.CodeInvalidArgument || !strings.Contains(eb.Error.Message, "allow_cmd") {
		t.Fatalf("an empty allowlist: %d %.300s, want 400 invalid_argument", status, raw)
	}
	if after := b.RedisSnapshot(); !maps.Equal(before, after) {
		t.Fatal("a refused mint changed Redis")
	}
	// The Go SDK sends an empty list as one, not as no list.
	if _, err := b.Client.Delegate(t.Context(), "dev", protocol.MintRequest{Scopes: []string{"exec"}, AllowCmd: []string{}}); code(err) != protocol.CodeInvalidArgument {
		t.Fatalf("an empty allowlist through the SDK: %v, want invalid_argument", err)
	}
}

// A request with two Authorization headers says two things too: which one a proxy in front of the
// broker checked is anyone's guess, so it is refused, on every route, whatever the two say.
func TestOneAuthorizationHeader(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "dev"})
	if err != nil {
		t.Fatal(err)
	}
	other := b.NewClient("org-b").APIKey()
	for _, path := range []string{"/v1/sandboxes", "/v1/sandboxes/dev", "/v1/events?follow=false", "/v1/sandboxes/" + res.Sandbox.ID + "/dataplane", "/metrics"} {
		for _, pair := range [][2]string{{other, b.Client.APIKey()}, {b.Client.APIKey(), b.Client.APIKey()}} {
			req, _ := http.NewRequestWithContext(t.Context(), "GET", b.URL+path, nil)
			req.Header.Add("Authorization", "Bearer "+pair[0])
			req.Header.Add("Authorization", "Bearer "+pair[1])
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var eb protocol.ErrorBody
			json.Unmarshal(raw, &eb)
			if resp.StatusCode != 400 || eb.Error.Code != protocol.CodeInvalidArgument || !strings.Contains(eb.Error.Message, "one Authorization header") {
				t.Errorf("GET %s with two Authorization headers: %d %.200s, want 400 invalid_argument", path, resp.StatusCode, raw)
			}
			if strings.Contains(string(raw), pair[0]) || strings.Contains(string(raw), pair[1]) {
				t.Errorf("GET %s: the answer echoes a credential", path)
			}
		}
	}
}

// The dataplane takes one credential, in the Authorization header or in one sbx.bearer.
// subprotocol (for browsers), never both and never two subprotocols: the broker read the header
// first and the first subprotocol, where a proxy in front of it may check another.
func TestDataplaneTakesOneCredential(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "dev"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(t.Context(), "dev", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	url := dataplaneURL(b, res.Sandbox.ID)
	other := b.NewClient("org-b").APIKey()
	bearerProto := func(cred string) string { return protocol.BearerSubprotocolPrefix + cred }
	for _, tc := range []struct {
		name   string
		hdr    http.Header
		protos []string
	}{
		{"a header and a subprotocol", authHeader(other), []string{protocol.Subprotocol, bearerProto(m.Token)}},
		{"two subprotocols", nil, []string{protocol.Subprotocol, bearerProto(m.Token), bearerProto(other)}},
		// The header may come as several lines (RFC 6455 4.1), and the broker's WebSocket library
		// reads only the first: a second line's credential went unseen.
		{"two subprotocols on two header lines", http.Header{"Sec-Websocket-Protocol": {protocol.Subprotocol + ", " + bearerProto(m.Token), bearerProto(other)}}, nil},
		{"a header and a subprotocol on a second line", http.Header{"Authorization": {"Bearer " + other}, "Sec-Websocket-Protocol": {protocol.Subprotocol, bearerProto(m.Token)}}, nil},
	} {
		status, eb := dialStatus(t, url, tc.hdr, tc.protos)
		if status != 400 || eb.Error.Code != protocol.CodeInvalidArgument || !strings.Contains(eb.Error.Message, "one credential") {
			t.Errorf("%s: %d %+v, want 400 invalid_argument", tc.name, status, eb.Error)
		}
	}
	if status, _ := dialStatus(t, url, nil, []string{protocol.Subprotocol, bearerProto(m.Token)}); status != http.StatusSwitchingProtocols {
		t.Errorf("one credential in a subprotocol: %d, want 101", status)
	}
}

// The dataplane decodes as strictly as REST (one decoder, decodeStrict): an exec whose args name its
// command twice, or in another case, or a request frame whose op is given twice, is refused and
// runs nothing, where the last (or the folded) key used to win.
func TestAmbiguousDataplaneJSONIsRefused(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	_, url := newSandbox(t, b, "dev")
	c := dialRaw(t, url, b.Client.APIKey())
	for i, frame := range []string{
		`{"id":1,"op":"exec","args":{"command":"echo first","command":"echo second"}}`,
		`{"id":2,"op":"exec","args":{"command":"echo first","COMMAND":"echo second"}}`,
		`{"id":3,"op":"exec","args":{"command":"echo \ud800"}}`,
		`{"id":4,"op":"ping","op":"exec","args":{"command":"echo op"}}`,
	} {
		c.sendText(frame)
		id := uint32(i + 1)
		if i == 3 {
			id = 0 // a request frame that cannot be read is answered with id 0
		}
		if got := c.await(id); got.Error == nil {
			t.Errorf("%s: answered %s, want a refusal", frame, got.Result)
		}
	}
	c.ping()
}
