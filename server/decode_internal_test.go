package server

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// A body of the wrong shape is described in JSON's words, naming the field, never in Go's
// (protocol.CreateSandboxRequest, map[string]string, int64): the person reading the answer wrote
// JSON.
func TestJSONProblemSpeaksJSON(t *testing.T) {
	for body, want := range map[string]string{
		`[]`:                  "the body must be a JSON object",
		`"x"`:                 "the body must be a JSON object",
		`{"name":1}`:          `field "name" has a number where a string belongs`,
		`{"tags":"a"}`:        `field "tags" has a string where an object belongs`,
		`{"tags":{"k":1}}`:    `field "tags" has a number where a string belongs`,
		`{"ttl_seconds":"5"}`: `field "ttl_seconds" has a string where an integer belongs`,
		`{"ttl_seconds":1.5}`: `field "ttl_seconds" has a number where an integer belongs`,
		`{"reuse":"yes"}`:     `field "reuse" has a string where true or false belongs`,
		`{"bogus":true}`:      `unknown field "bogus"`,
		`{"name":`:            "unexpected end of input",
		`{"name" 1}`:          "syntax error at byte 9",
	} {
		var req protocol.CreateSandboxRequest
		dec := json.NewDecoder(strings.NewReader(body))
		dec.DisallowUnknownFields()
		err := dec.Decode(&req)
		if err == nil {
			t.Fatalf("%s: decoded", body)
		}
		if got := jsonProblem(err); got != want {
			t.Errorf("%s: %q, want %q", body, got, want)
		}
	}
	var m protocol.MintRequest
	if got := jsonProblem(json.Unmarshal([]byte(`{"scopes":"exec"}`), &m)); got != `field "scopes" has a string where an array belongs` {
		t.Errorf("scopes: %q", got)
	}
}
