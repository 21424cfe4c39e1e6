package server_test

import (
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// A delegate token cannot tell which sandboxes exist in its owner's org: on the dataplane URL of
// another sandbox of the org it gets exactly the answer of a sandbox that does not exist. Its own
// sandbox still answers by id and by name.
func TestDataplaneNoSandboxNameOracle(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	mine, _ := newSandbox(t, b, "mine")
	parked, _ := newSandbox(t, b, "parked")
	if _, err := b.Client.StopSandbox(t.Context(), "parked"); err != nil {
		t.Fatal(err)
	}
	sibling, _ := newSandbox(t, b, "sibling")
	m, err := b.Client.Delegate(t.Context(), mine, protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	hdr := authHeader(m.Token)
	protos := []string{protocol.Subprotocol}
	type answer struct {
		status  int
		code    string
		message string
	}
	try := func(ref string) answer {
		status, eb := dialStatus(t, dataplaneURL(b, ref), hdr, protos)
		// The message names the ref asked for; anything else in it must be the same.
		return answer{status, eb.Error.Code, strings.ReplaceAll(eb.Error.Message, ref, "REF")}
	}
	missingName := try("nosuch")
	missingID := try("sb_00000000-0000-4000-8000-000000000000")
	if missingName.status != 404 || missingName.code != protocol.CodeNotFound {
		t.Fatalf("a missing name: %+v, want 404 not_found", missingName)
	}
	for ref, what := range map[string]string{"sibling": "a running sandbox's name", sibling: "a running sandbox's id",
		"parked": "a stopped sandbox's name", parked: "a stopped sandbox's id"} {
		got := try(ref)
		want := missingName
		if strings.HasPrefix(ref, "sb_") {
			want = missingID
		}
		if got != want {
			t.Errorf("%s: %+v, but a missing one gets %+v", what, got, want)
		}
	}
	for _, ref := range []string{mine, "mine"} {
		c := dialRaw(t, dataplaneURL(b, ref), m.Token)
		c.ping()
	}
}

// Holding a token tells nothing on owner routes beyond what the token itself says: a revoked token,
// a token of a deleted sandbox and a live one get the same answer, which consults no revocation
// state.
func TestOwnerRoutesNoRevocationOracle(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	for _, n := range []string{"live", "revoked", "gone"} {
		newSandbox(t, b, n)
	}
	mint := func(ref string) protocol.MintResponse {
		m, err := b.Client.Delegate(t.Context(), ref, protocol.MintRequest{Scopes: []string{"fs:read"}})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	live, revoked, gone := mint("live"), mint("revoked"), mint("gone")
	if _, err := b.Client.Revoke(t.Context(), "revoked", revoked.JTI); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.DeleteSandbox(t.Context(), "gone"); err != nil {
		t.Fatal(err)
	}
	routes := []struct{ method, path, body string }{
		{"GET", "/v1/sandboxes", ""},
		{"GET", "/v1/sandboxes/live", ""},
		{"DELETE", "/v1/sandboxes/live/delegations", ""},
		{"POST", "/v1/tokens/introspect", `{"token":"x"}`},
		{"GET", "/v1/events?follow=false", ""},
	}
	for _, r := range routes {
		status, eb, _ := rawRequest(t, r.method, b.URL+r.path, live.Token, r.body)
		if status != 403 || eb.Error.Code != protocol.CodeDelegateForbidden {
			t.Fatalf("%s %s with a live token: %d %+v, want 403 delegate_forbidden", r.method, r.path, status, eb)
		}
		for name, tok := range map[string]string{"revoked": revoked.Token, "of a deleted sandbox": gone.Token} {
			s2, eb2, _ := rawRequest(t, r.method, b.URL+r.path, tok, r.body)
			if s2 != status || eb2.Error.Code != eb.Error.Code || eb2.Error.Message != eb.Error.Message {
				t.Errorf("%s %s: a token %s gets %d %+v, a live one %d %+v", r.method, r.path, name, s2, eb2, status, eb)
			}
		}
	}
}
