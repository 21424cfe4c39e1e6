package server_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

func TestMain(m *testing.M) { servertest.Main(m) }

func code(err error) string {
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return pe.Code
	}
	if err != nil {
		return "non-protocol: " + err.Error()
	}
	return ""
}

func TestLifecycle(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	c, ctx := b.Client, t.Context()
	ttl := int64(600)
	res, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev", TTLSeconds: &ttl, Tags: map[string]string{"thread_id": "t1"}})
	if err != nil || res.Outcome != "created" || res.Sandbox.Status != "running" || res.Sandbox.ExpiresAt == nil {
		t.Fatalf("create: %v %+v", err, res)
	}
	id := res.Sandbox.ID
	again, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"})
	if err != nil || again.Outcome != "reused" || again.Sandbox.ID != id {
		t.Fatalf("reuse: %v %+v", err, again)
	}
	// A file written into the workspace survives stop and resume.
	ws := filepath.Join(b.DataDir, "sandboxes", id, "workspace")
	if err := os.WriteFile(filepath.Join(ws, "keep.txt"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	st, err := c.StopSandbox(ctx, "dev")
	if err != nil || st.Status != "stopped" || st.StopReason != "requested" || st.ExpiresAt != nil {
		t.Fatalf("stop: %v %+v", err, st)
	}
	if _, err := c.Heartbeat(ctx, "dev"); code(err) != protocol.CodeNotRunning {
		t.Fatalf("heartbeat of a stopped sandbox: %v", err)
	}
	if st, err = c.StopSandbox(ctx, id); err != nil || st.Status != "stopped" {
		t.Fatalf("second stop must be a no-op: %v", err)
	}
	rs, err := c.ResumeSandbox(ctx, "dev")
	if err != nil || rs.Status != "running" || rs.StopReason != "" {
		t.Fatalf("resume: %v %+v", err, rs)
	}
	if b, _ := os.ReadFile(filepath.Join(ws, "keep.txt")); string(b) != "kept" {
		t.Fatalf("file lost across stop/resume: %q", b)
	}
	c.StopSandbox(ctx, "dev")
	re, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"})
	if err != nil || re.Outcome != "resumed" || re.Sandbox.Status != "running" {
		t.Fatalf("create of a stopped name must resume it: %v %+v", err, re)
	}
	hb, err := c.Heartbeat(ctx, "dev")
	if err != nil || hb.ExpiresAt == nil || hb.SandboxID != id {
		t.Fatalf("heartbeat: %v %+v", err, hb)
	}
	l, err := c.SetTTL(ctx, "dev", 3600e9)
	if err != nil || l.TTLSeconds != 3600 {
		t.Fatalf("ttl: %v %+v", err, l)
	}
	env, err := c.Environment(ctx, "dev")
	if err != nil || env.Env["PATH"] == "" {
		t.Fatalf("environment: %v %+v", err, env)
	}
	list, err := c.ListAllSandboxes(ctx, client.ListOptions{Tags: map[string]string{"thread_id": "t1"}})
	if err != nil || len(list) != 1 || list[0].ID != id {
		t.Fatalf("list by tag: %v %+v", err, list)
	}
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev", Reuse: new(bool)}); code(err) != protocol.CodeNameConflict {
		t.Fatalf("no-reuse create of a taken name: %v", err)
	}
	del, err := c.DeleteSandbox(ctx, "dev")
	if err != nil || len(del.Deleted) != 1 {
		t.Fatalf("delete: %v", err)
	}
	if _, err := os.Stat(ws); !os.IsNotExist(err) {
		t.Fatalf("workspace still there after delete: %v", err)
	}
	if _, err := c.GetSandbox(ctx, id); code(err) != protocol.CodeNotFound {
		t.Fatalf("get after delete: %v", err)
	}
}

func TestDeleteByTag(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	c, ctx := b.Client, t.Context()
	for i := 0; i < 3; i++ {
		c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: fmt.Sprintf("ci-%d", i), Tags: map[string]string{"ci": "yes"}})
	}
	c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "keep"})
	dry, err := c.DeleteSandboxes(ctx, map[string]string{"ci": "yes"}, true)
	if err != nil || !dry.DryRun || len(dry.Deleted) != 3 {
		t.Fatalf("dry run: %v %+v", err, dry)
	}
	if all, _ := c.ListAllSandboxes(ctx, client.ListOptions{}); len(all) != 4 {
		t.Fatalf("dry run deleted something: %d left", len(all))
	}
	res, err := c.DeleteSandboxes(ctx, map[string]string{"ci": "yes"}, false)
	if err != nil || len(res.Deleted) != 3 {
		t.Fatalf("delete by tag: %v %+v", err, res)
	}
	all, _ := c.ListAllSandboxes(ctx, client.ListOptions{})
	if len(all) != 1 || all[0].Name != "keep" {
		t.Fatalf("left: %+v", all)
	}
	if _, err := c.DeleteSandboxes(ctx, nil, false); code(err) != protocol.CodeInvalidTag {
		t.Fatalf("batch delete without selector must refuse: %v", err)
	}
}

func TestConcurrentCreatesOfOneName(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	outcomes := map[string]int{}
	ids := map[string]bool{}
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := b.Client.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "shared"})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				outcomes["error: "+code(err)]++
				return
			}
			outcomes[res.Outcome]++
			ids[res.Sandbox.ID] = true
			if res.Sandbox.Status != "running" {
				outcomes["not running: "+res.Sandbox.Status]++
			}
		}()
	}
	wg.Wait()
	if outcomes["created"] != 1 || outcomes["reused"] != 49 || len(ids) != 1 || len(outcomes) != 2 {
		t.Fatalf("want 1 created + 49 reused, all running, one id; got %v over %d ids", outcomes, len(ids))
	}
	all, _ := b.Client.ListAllSandboxes(context.Background(), client.ListOptions{})
	if len(all) != 1 {
		t.Fatalf("want one record, got %d", len(all))
	}
	dirs, _ := os.ReadDir(filepath.Join(b.DataDir, "sandboxes"))
	if len(dirs) != 1 {
		t.Fatalf("want one workspace, got %d", len(dirs))
	}
}

// rawRequest sends a request with a raw body and returns status and decoded error.
func rawRequest(t *testing.T, method, url, key, body string) (int, protocol.ErrorBody, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var eb protocol.ErrorBody
	json.Unmarshal(raw, &eb)
	return resp.StatusCode, eb, raw
}

func TestOrgIsolation(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	a, other := b.Client, b.NewClient("org-b")
	ctx := t.Context()
	res, err := a.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "private"})
	if err != nil {
		t.Fatal(err)
	}
	minted, err := a.Delegate(ctx, "private", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	before := b.RedisSnapshot()
	for _, ref := range []string{res.Sandbox.ID, "private", strings.ToUpper(res.Sandbox.ID)} {
		for _, op := range []struct {
			method, path string
		}{
			{"GET", ""}, {"POST", "/stop"}, {"POST", "/resume"}, {"POST", "/heartbeat"}, {"DELETE", ""},
			{"POST", "/ttl"}, {"GET", "/environment"}, {"POST", "/delegations"}, {"GET", "/delegations"},
			{"DELETE", "/delegations"}, {"DELETE", "/delegations/" + minted.JTI}, {"GET", "/events"},
			{"PUT", "/dataplane/upload"},
		} {
			body := ""
			if op.path == "/ttl" {
				body = `{"ttl_seconds":60}`
			}
			if op.path == "/delegations" && op.method == "POST" {
				body = `{"scopes":["exec"]}`
			}
			status, eb, raw := rawRequest(t, op.method, b.URL+"/v1/sandboxes/"+ref+op.path, other.APIKey(), body)
			// The same answer as for a sandbox that does not exist, request id aside.
			_, missing, _ := rawRequest(t, op.method, b.URL+"/v1/sandboxes/"+strings.Replace(ref, "private", "nosuch", 1)+op.path, other.APIKey(), body)
			if status != 404 || eb.Error.Code != "not_found" {
				t.Errorf("org-b %s %s%s: %d %s", op.method, ref, op.path, status, raw)
			}
			if strings.Replace(eb.Error.Message, ref, "X", 1) != strings.Replace(missing.Error.Message, strings.Replace(ref, "private", "nosuch", 1), "X", 1) {
				t.Errorf("org-b %s %s%s: message differs from a missing sandbox's: %q vs %q", op.method, ref, op.path, eb.Error.Message, missing.Error.Message)
			}
		}
	}
	if list, _ := other.ListAllSandboxes(ctx, client.ListOptions{}); len(list) != 0 {
		t.Fatalf("org-b lists org-a's sandboxes: %+v", list)
	}
	if after := b.RedisSnapshot(); !maps.Equal(before, after) {
		t.Fatalf("org-b's requests changed Redis")
	}
	if s, err := a.GetSandbox(ctx, "private"); err != nil || s.Status != "running" {
		t.Fatalf("org-a's sandbox changed: %v %+v", err, s)
	}
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	key := b.Client.APIKey()
	b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "exists"})
	long := strings.Repeat("a", 64)
	manyTags := map[string]string{}
	for i := 0; i < 17; i++ {
		manyTags[fmt.Sprintf("k%d", i)] = "v"
	}
	manyJSON, _ := json.Marshal(map[string]any{"name": "x", "tags": manyTags})
	cases := []struct {
		name, method, path, key, body string
		status                        int
		code                          string
	}{
		{"malformed json", "POST", "/v1/sandboxes", key, `{"name":`, 400, "invalid_json"},
		{"json array", "POST", "/v1/sandboxes", key, `[1,2]`, 400, "invalid_json"},
		{"unknown field", "POST", "/v1/sandboxes", key, `{"name":"a","ttl":5}`, 400, "invalid_json"},
		{"wrong type", "POST", "/v1/sandboxes", key, `{"name":5}`, 400, "invalid_json"},
		{"trailing data", "POST", "/v1/sandboxes", key, `{"name":"a"} {}`, 400, "invalid_json"},
		{"huge body", "POST", "/v1/sandboxes", key, `{"name":"` + strings.Repeat("a", 2<<20) + `"}`, 413, "payload_too_large"},
		{"unknown template", "POST", "/v1/sandboxes", key, `{"name":"a","template":"nope"}`, 400, "unknown_template"},
		{"empty name", "POST", "/v1/sandboxes", key, `{}`, 400, "invalid_name"},
		{"uppercase name", "POST", "/v1/sandboxes", key, `{"name":"Dev"}`, 400, "invalid_name"},
		{"overlong name", "POST", "/v1/sandboxes", key, `{"name":"` + long + `"}`, 400, "invalid_name"},
		{"name with slash", "POST", "/v1/sandboxes", key, `{"name":"a/b"}`, 400, "invalid_name"},
		{"name looks like an id", "POST", "/v1/sandboxes", key, `{"name":"sb_x"}`, 400, "invalid_name"},
		{"negative ttl", "POST", "/v1/sandboxes", key, `{"name":"a","ttl_seconds":-5}`, 400, "invalid_ttl"},
		{"zero ttl", "POST", "/v1/sandboxes", key, `{"name":"a","ttl_seconds":0}`, 400, "invalid_ttl"},
		{"absurd ttl", "POST", "/v1/sandboxes", key, `{"name":"a","ttl_seconds":99999999999}`, 400, "invalid_ttl"},
		{"float ttl", "POST", "/v1/sandboxes", key, `{"name":"a","ttl_seconds":1.5}`, 400, "invalid_json"},
		// ttl_seconds*time.Second would wrap: to 4.29 s, and to a negative lease.
		{"ttl that wraps to seconds", "POST", "/v1/sandboxes", key, `{"name":"a","ttl_seconds":18446744078}`, 400, "invalid_ttl"},
		{"ttl that wraps negative", "POST", "/v1/sandboxes", key, `{"name":"a","ttl_seconds":1099511627776}`, 400, "invalid_ttl"},
		{"ttl over max", "POST", "/v1/sandboxes", key, `{"name":"a","ttl_seconds":604801}`, 400, "invalid_ttl"},
		{"bad tag key", "POST", "/v1/sandboxes", key, `{"name":"a","tags":{"bad key":"v"}}`, 400, "invalid_tag"},
		{"control char in tag", "POST", "/v1/sandboxes", key, `{"name":"a","tags":{"k":"a\u0001b"}}`, 400, "invalid_tag"},
		{"too many tags", "POST", "/v1/sandboxes", key, string(manyJSON), 400, "invalid_tag"},
		{"bad tag selector", "GET", "/v1/sandboxes?tag=novalue", key, "", 400, "invalid_tag"},
		{"bad status", "GET", "/v1/sandboxes?status=sleeping", key, "", 400, "invalid_status"},
		{"bad limit", "GET", "/v1/sandboxes?limit=0", key, "", 400, "invalid_argument"},
		{"bad cursor", "GET", "/v1/sandboxes?cursor=zzz", key, "", 400, "invalid_cursor"},
		{"ttl missing", "POST", "/v1/sandboxes/exists/ttl", key, `{}`, 400, "invalid_ttl"},
		{"ttl absurd", "POST", "/v1/sandboxes/exists/ttl", key, `{"ttl_seconds":1e12}`, 400, "invalid_json"},
		{"ttl zero", "POST", "/v1/sandboxes/exists/ttl", key, `{"ttl_seconds":0}`, 400, "invalid_ttl"},
		{"ttl that wraps", "POST", "/v1/sandboxes/exists/ttl", key, `{"ttl_seconds":18446744078}`, 400, "invalid_ttl"},
		{"delete without selector", "DELETE", "/v1/sandboxes", key, "", 400, "invalid_tag"},
		{"no key", "GET", "/v1/sandboxes", "", "", 401, "unauthenticated"},
		{"wrong key", "GET", "/v1/sandboxes", "sbk_aaaaaaaaaaaaaaaa_" + strings.Repeat("b", 43), "", 401, "unauthenticated"},
		{"garbage credential", "POST", "/v1/sandboxes", "garbage", `{"name":"a"}`, 401, "token_malformed"},
		{"unknown route", "GET", "/v1/nope", key, "", 404, "route_not_found"},
		{"missing sandbox", "POST", "/v1/sandboxes/nosuch/stop", key, "", 404, "not_found"},
		{"wrong method", "PUT", "/v1/sandboxes", key, "", 405, "method_not_allowed"},
	}
	for _, tc := range cases {
		before := b.RedisSnapshot()
		status, eb, raw := rawRequest(t, tc.method, b.URL+tc.path, tc.key, tc.body)
		if status != tc.status || eb.Error.Code != tc.code || eb.Error.Message == "" || eb.Error.RequestID == "" {
			t.Errorf("%s: got %d %.200s, want %d %s", tc.name, status, raw, tc.status, tc.code)
		}
		if bytes.Contains(raw, []byte(key)) {
			t.Errorf("%s: the answer echoes the API key", tc.name)
		}
		if after := b.RedisSnapshot(); !maps.Equal(before, after) {
			t.Errorf("%s: a refused request changed Redis", tc.name)
		}
	}
	// A lease out of range is refused with the range allowed (servertest's --max-ttl is 7 days).
	for path, body := range map[string]string{
		"/v1/sandboxes":            `{"name":"a","ttl_seconds":18446744078}`,
		"/v1/sandboxes/exists/ttl": `{"ttl_seconds":18446744078}`,
	} {
		if _, eb, _ := rawRequest(t, "POST", b.URL+path, key, body); !strings.Contains(eb.Error.Message, "1 to 604800") {
			t.Errorf("%s: %q does not say the range allowed", path, eb.Error.Message)
		}
	}
	// An unknown template is refused with the names there are.
	if _, eb, _ := rawRequest(t, "POST", b.URL+"/v1/sandboxes", key, `{"name":"a","template":"nope"}`); !strings.Contains(eb.Error.Message, "default") {
		t.Errorf("unknown template: %q does not name the templates there are", eb.Error.Message)
	}
	// A wrong key and a wrong method say what to do about them.
	if _, eb, _ := rawRequest(t, "GET", b.URL+"/v1/sandboxes", "sbk_wrong_key", ""); eb.Error.Code != "unauthenticated" || !strings.Contains(eb.Error.Message, "broker keys create") {
		t.Errorf("a wrong API key: %+v does not say where keys come from", eb.Error)
	}
	if _, eb, _ := rawRequest(t, "PATCH", b.URL+"/v1/sandboxes", key, ""); eb.Error.Code != "method_not_allowed" || !strings.Contains(eb.Error.Message, "Allow") {
		t.Errorf("a wrong method: %+v does not point at the Allow header", eb.Error)
	}
	// A missing sandbox says where the org's are listed.
	if _, eb, _ := rawRequest(t, "GET", b.URL+"/v1/sandboxes/nope", key, ""); eb.Error.Code != "not_found" || !strings.Contains(eb.Error.Message, "sbctl list") {
		t.Errorf("a missing sandbox: %+v does not say where sandboxes are listed", eb.Error)
	}
}

func TestDelegationOnOwnerRoutes(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	res, _ := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "lent"})
	m, err := b.Client.Delegate(ctx, "lent", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	if m.Sandbox.SandboxID != res.Sandbox.ID || m.Sandbox.Credential != m.Token || !strings.HasPrefix(m.Sandbox.DataplaneURL, "ws://") {
		t.Fatalf("block: %+v", m.Sandbox)
	}
	delegate, _ := client.New(b.URL, m.Token)
	for _, call := range []func() error{
		func() error { _, err := delegate.GetSandbox(ctx, "lent"); return err },
		func() error { _, err := delegate.StopSandbox(ctx, "lent"); return err },
		func() error { _, err := delegate.DeleteSandbox(ctx, "lent"); return err },
		func() error { _, err := delegate.ListSandboxes(ctx, client.ListOptions{}); return err },
		func() error {
			_, err := delegate.Delegate(ctx, "lent", protocol.MintRequest{Scopes: []string{"exec"}})
			return err
		},
		func() error { _, err := delegate.RevokeAll(ctx, "lent"); return err },
		func() error { _, err := delegate.Introspect(ctx, m.Token); return err },
	} {
		if err := call(); code(err) != protocol.CodeDelegateForbidden {
			t.Errorf("delegate on an owner route: want delegate_forbidden, got %v", err)
		}
	}
	in, err := b.Client.Introspect(ctx, m.Token)
	if err != nil || !in.Active || in.SandboxID != res.Sandbox.ID || len(in.Scopes) != 3 {
		t.Fatalf("introspect: %v %+v", err, in)
	}
	// Another org's server learns nothing about the token.
	if in, err := b.NewClient("org-b").Introspect(ctx, m.Token); err != nil || in.Active || in.SandboxID != "" || in.Reason != "" {
		t.Fatalf("introspect from another org: %v %+v", err, in)
	}
	list, err := b.Client.ListDelegations(ctx, "lent")
	if err != nil || len(list.Items) != 1 || list.Items[0].JTI != m.JTI {
		t.Fatalf("list: %v %+v", err, list)
	}
	raw, _ := json.Marshal(list)
	if bytes.Contains(raw, []byte(m.Token)) {
		t.Fatal("listing carries the token")
	}
	if _, err := b.Client.Revoke(ctx, "lent", m.JTI); err != nil {
		t.Fatal(err)
	}
	if in, _ := b.Client.Introspect(ctx, m.Token); in.Active || in.Reason != protocol.CodeTokenRevoked {
		t.Fatalf("revoked token still active: %+v", in)
	}
	if in, err := b.NewClient("org-b").Introspect(ctx, m.Token); err != nil || in.Active || in.Reason != "" {
		t.Fatalf("another org learns that the token was revoked: %v %+v", err, in)
	}
	// Revoke-all by generation, and delete, end every token.
	m2, _ := b.Client.Delegate(ctx, "lent", protocol.MintRequest{Scopes: []string{"exec"}})
	b.Client.RevokeAll(ctx, "lent")
	if in, _ := b.Client.Introspect(ctx, m2.Token); in.Active || in.Reason != protocol.CodeTokenRevoked {
		t.Fatalf("revoke-all: %+v", in)
	}
	m3, _ := b.Client.Delegate(ctx, "lent", protocol.MintRequest{Scopes: []string{"exec"}})
	if in, _ := b.Client.Introspect(ctx, m3.Token); !in.Active {
		t.Fatalf("token minted after revoke-all must work: %+v", in)
	}
	b.Client.DeleteSandbox(ctx, "lent")
	if in, _ := b.Client.Introspect(ctx, m3.Token); in.Active {
		t.Fatalf("token of a deleted sandbox still active: %+v", in)
	}
	for _, bad := range []protocol.MintRequest{
		{Scopes: nil}, {Scopes: []string{"root"}}, {Scopes: []string{"exec"}, AllowCmd: []string{"rm -rf"}},
		{Scopes: []string{"exec"}, TTLSeconds: new(int64)},
	} {
		b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "again"})
		if _, err := b.Client.Delegate(ctx, "again", bad); err == nil {
			t.Errorf("mint %+v: want an error", bad)
		}
	}
	// A lifetime past the maximum names the maximum as a duration and the setting that sets it.
	long := int64(48 * 3600)
	if _, err := b.Client.Delegate(ctx, "again", protocol.MintRequest{Scopes: []string{"exec"}, TTLSeconds: &long}); code(err) != protocol.CodeInvalidTTL ||
		!strings.Contains(err.Error(), "24h0m0s, the broker's --token-max-ttl") {
		t.Errorf("mint for 48h: %v", err)
	}
	jwks, err := http.Get(b.URL + "/.well-known/jwks.json")
	if err != nil || jwks.StatusCode != 200 {
		t.Fatalf("jwks: %v", err)
	}
	var set struct{ Keys []map[string]string }
	json.NewDecoder(jwks.Body).Decode(&set)
	jwks.Body.Close()
	if len(set.Keys) != 1 || set.Keys[0]["kty"] != "OKP" || set.Keys[0]["d"] != "" {
		t.Fatalf("jwks: %+v", set)
	}
}

// The router and docs/openapi.yaml describe the same routes.
func TestRoutesMatchOpenAPI(t *testing.T) {
	spec, err := servertest.LoadSpec()
	if err != nil {
		t.Fatal(err)
	}
	b := servertest.New(t, servertest.Options{})
	got := strings.Join(b.Server.Routes(), "\n")
	want := strings.Join(spec.Operations(), "\n")
	if got != want {
		t.Fatalf("routes differ from docs/openapi.yaml\nrouter:\n%s\n\nspec:\n%s", got, want)
	}
}

// Every route's refusals of a wrong caller are in docs/openapi.yaml, status and body: no
// credentials, a delegation token on an owner route (403 delegate_forbidden, which the spec's
// preamble promises everywhere), a query parameter the route does not take (400), and, with Redis
// gone, the 503 unavailable the preamble promises for every call that needs it. A client generated
// from the spec must not meet a status it was never told about.
func TestRouteRefusalsMatchOpenAPI(t *testing.T) {
	t.Parallel()
	spec, err := servertest.LoadSpec()
	if err != nil {
		t.Fatal(err)
	}
	logs := &wait.Buffer{}
	b := servertest.New(t, servertest.Options{Log: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	ctx := t.Context()
	sb, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "doc"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, "doc", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	key, _, err := b.Store.CreateAPIKey(ctx, b.Org, "raw", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	// check sends op (METHOD /path/{ref}) with credential, query and body, and checks the answer.
	check := func(op, why, credential, query, body string) {
		t.Helper()
		method, path, _ := strings.Cut(op, " ")
		path = strings.NewReplacer("{ref}", sb.Sandbox.ID, "{jti}", m.JTI).Replace(path)
		if strings.HasSuffix(path, "/events") {
			query = strings.TrimPrefix(query+"&follow=false", "&")
		}
		url := b.URL + path
		if query != "" {
			url += "?" + query
		}
		req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		for _, c := range strings.Fields(credential) { // several: one header each
			req.Header.Add("Authorization", "Bearer "+c)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		answer, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err := spec.CheckResponse(method, path, resp.StatusCode, resp.Header.Get("Content-Type"), answer); err != nil {
			t.Errorf("%s with %s: %v", op, why, err)
		}
	}
	huge := `{"x":"` + strings.Repeat("a", 2<<20) + `"}`
	for _, op := range spec.Operations() {
		check(op, "no credentials", "", "", "{}")
		check(op, "a delegation token", m.Token, "", "{}")
		check(op, "an unknown query parameter", key, "bogus=1", "{}")
		check(op, "two Authorization headers", m.Token+" "+key, "", "{}")
		if strings.HasPrefix(op, "POST") {
			check(op, "a malformed body", key, "", "{")
			check(op, "a 2 MiB body", key, "", huge)
		}
	}
	check("DELETE /v1/sandboxes", "no tag selector", key, "", "")
	// A refusal is the caller's mistake: it is never logged as the broker's error, and no log line
	// carries a credential.
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, `"level":"ERROR"`) {
			t.Errorf("a refusal logged as the broker's error: %.300s", line)
		}
		if strings.Contains(line, key) || strings.Contains(line, m.Token) {
			t.Errorf("a log line carries a credential: %.300s", line)
		}
	}
	// The MCP endpoint takes a token; one never used, so that no cache of this broker answers for it.
	fresh, err := b.Client.Delegate(ctx, "doc", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
	if err != nil {
		t.Fatal(err)
	}
	b.Redis.Kill()
	for _, op := range spec.Operations() {
		check(op, "Redis gone", key, "", "{}")
		if strings.HasSuffix(op, "/mcp") {
			check(op, "Redis gone, a delegation token", fresh.Token, "", `{"jsonrpc":"2.0","id":1,"method":"ping"}`)
		}
	}
}

// Verified API keys are cached briefly; a revocation still takes effect at once.
func TestRevokedKeyStopsAtOnce(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	key, k, err := b.Store.CreateAPIKey(ctx, b.Org, "short-lived", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	c, _ := client.New(b.URL, key)
	if _, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil {
		t.Fatal(err) // now cached
	}
	if _, err := b.Store.RevokeAPIKey(ctx, k.ID, time.Now()); err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, 500*time.Millisecond, func() bool {
		_, err := c.ListSandboxes(ctx, client.ListOptions{})
		return code(err) == protocol.CodeUnauthenticated
	}, "a revoked key refused (unauthenticated)")
}

func TestTemplatesAndSetup(t *testing.T) {
	t.Parallel()
	tmpl := map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"py":      {Name: "py", Env: map[string]string{"STACK": "python"}, Setup: "echo ready > .setup-done"},
		"broken":  {Name: "broken", Setup: "echo boom >&2; exit 7"},
	}
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: tmpl})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "ok", Template: "py"})
	if err != nil || res.Sandbox.Status != "running" || res.Sandbox.Template != "py" {
		t.Fatalf("create from template: %v %+v", err, res)
	}
	done, _ := os.ReadFile(filepath.Join(b.DataDir, "sandboxes", res.Sandbox.ID, "workspace", ".setup-done"))
	if string(done) != "ready\n" {
		t.Fatalf("setup did not run in the workspace: %q", done)
	}
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "ok", Template: "default"}); code(err) != protocol.CodeNameConflict ||
		!strings.Contains(err.Error(), `another template ("py")`) {
		t.Fatalf("reuse with another template: %v", err)
	}
	if env, err := b.Client.Environment(ctx, "ok"); err != nil || env.Env["STACK"] != "python" || env.Env["HOME"] != "/home/user" {
		t.Fatalf("template env: %v %+v", err, env.Env)
	}
	_, err = b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "bad", Template: "broken"})
	if code(err) != protocol.CodeSandboxFailed || !strings.Contains(err.Error(), "exited 7") {
		t.Fatalf("failed setup: %v", err)
	}
	got, err := b.Client.GetSandbox(ctx, "bad")
	if err != nil || got.Status != "failed" || !strings.Contains(got.Failure, "exited 7") || !strings.Contains(got.Failure, "boom") {
		t.Fatalf("failed sandbox record: %v %+v", err, got)
	}
	// The event says why with a code; the setup's output (which may echo template secrets) stays on
	// the record.
	var failed *protocol.Event
	wait.Until(5*time.Second, func() bool {
		for _, e := range sandboxEvents(t, b.Client, got.ID) {
			if e.Type == protocol.EventFailed {
				failed = &e
			}
		}
		return failed != nil
	})
	if failed == nil || failed.Reason != protocol.ReasonSetupFailed {
		t.Fatalf("failed event: %+v, want reason %s", failed, protocol.ReasonSetupFailed)
	}
	// A failed name is not silently reused; delete frees it.
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "bad", Template: "broken"}); code(err) != protocol.CodeSandboxFailed {
		t.Fatalf("reuse of a failed sandbox: %v", err)
	}
	if _, err := b.Client.DeleteSandbox(ctx, "bad"); err != nil {
		t.Fatal(err)
	}
}

func TestAppendLeaseMatchesEncodingJSON(t *testing.T) {
	at := time.Date(2026, 11, 21, 22, 0, 0, 123456000, time.UTC)
	for _, l := range []protocol.HeartbeatResponse{
		{SandboxID: "sb_6f1c2f9e-2b7d-4c57-9a4e-0d7a1c5e8b21", Status: "running", TTLSeconds: 1800, ExpiresAt: &at},
		{SandboxID: "sb_x", Status: "stopped", TTLSeconds: 0},
	} {
		got, ok := server.AppendLease(nil, l)
		var want bytes.Buffer
		json.NewEncoder(&want).Encode(l)
		if !ok || string(got) != want.String() {
			t.Errorf("appendLease %q, encoding/json %q", got, want.String())
		}
	}
	if _, ok := server.AppendLease(nil, protocol.HeartbeatResponse{SandboxID: "sb_<x>", Status: "running"}); ok {
		t.Error("a value that needs escaping must take encoding/json")
	}
}

func TestBatchHeartbeats(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	ctx := t.Context()
	var refs []string
	for i := 0; i < 5; i++ {
		res, _ := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: fmt.Sprintf("b%d", i)})
		refs = append(refs, res.Sandbox.ID)
	}
	b.Client.StopSandbox(ctx, refs[3])
	refs = append(refs, "b4", "nosuch")
	clock.Advance(time.Minute)
	res, err := b.Client.Heartbeats(ctx, refs)
	if err != nil || len(res.Items) != len(refs) {
		t.Fatalf("%v %+v", err, res)
	}
	for i, it := range res.Items {
		switch {
		case it.Ref != refs[i]:
			t.Errorf("item %d answers %s, want %s", i, it.Ref, refs[i])
		case i == 3 && (it.Error == nil || it.Error.Code != protocol.CodeNotRunning):
			t.Errorf("stopped sandbox: %+v", it)
		case i == 6 && (it.Error == nil || it.Error.Code != protocol.CodeNotFound):
			t.Errorf("missing sandbox: %+v", it)
		case i != 3 && i != 6 && (it.Lease == nil || !it.Lease.ExpiresAt.Equal(clock.Now().Add(30*time.Minute).Truncate(time.Millisecond))):
			t.Errorf("item %d: %+v", i, it)
		}
	}
	if _, err := b.Client.Heartbeats(ctx, nil); code(err) != protocol.CodeInvalidArgument {
		t.Fatalf("empty batch: %v", err)
	}
	// Another org's sandboxes are simply not found, in a batch too.
	other, _ := b.NewClient("org-b").Heartbeats(ctx, refs[:1])
	if other.Items[0].Error == nil || other.Items[0].Error.Code != protocol.CodeNotFound {
		t.Fatalf("org isolation: %+v", other)
	}
}

// initsIn counts the processes whose working directory is ws: a dir-provider sandbox's init runs
// there.
func initsIn(ws string) int {
	n := 0
	procs, _ := filepath.Glob("/proc/[0-9]*/cwd")
	for _, p := range procs {
		if dir, err := os.Readlink(p); err == nil && dir == ws {
			n++
		}
	}
	return n
}

// A broker that fails to start leaves no sandbox running: either it fails before recovering them,
// or it stops those it recovered.
func TestBrokerStartFailureLeavesNoSandboxRunning(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		breakIt func(t *testing.T, b *servertest.Broker)
	}{
		{"unsafe signing key directory", func(t *testing.T, b *servertest.Broker) {
			if err := os.Chmod(filepath.Join(b.DataDir, "signing"), 0o777); err != nil {
				t.Fatal(err)
			}
		}},
		{"node registration fails", func(t *testing.T, b *servertest.Broker) {
			// The nodes hash is a string now: HSET on it fails, after the sandboxes are recovered.
			if err := b.RDB.Set(t.Context(), store.NodesKey, "not a hash", 0).Err(); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := servertest.New(t, servertest.Options{Provider: "dir"})
			res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "survivor"})
			if err != nil {
				t.Fatal(err)
			}
			ws := filepath.Join(b.DataDir, "sandboxes", res.Sandbox.ID, "workspace")
			if initsIn(ws) == 0 {
				t.Fatalf("no process runs in %s: the check below would prove nothing", ws)
			}
			b.Stop()
			wait.Eventually(t, 5*time.Second, func() bool { return initsIn(ws) == 0 }, "the sandbox's processes gone after its broker's shutdown")
			tc.breakIt(t, b)
			prov, _, err := provider.Preflight(t.Context(), provider.Config{DataDir: b.DataDir}, "dir")
			if err != nil {
				t.Fatal(err)
			}
			br, err := server.NewBroker(t.Context(), server.BrokerConfig{
				Store: b.Store, Provider: prov, Templates: map[string]provider.Template{"default": provider.DefaultTemplate()},
				Node: "node-test", AdvertiseURL: b.URL, DataDir: b.DataDir, SigningKeys: filepath.Join(b.DataDir, "signing"),
				WorkspaceUID: -1, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour,
			})
			if err == nil {
				br.Shutdown(context.Background())
				t.Fatal("the broker started")
			}
			if n := initsIn(ws); n > 0 {
				t.Errorf("%d processes left running in the sandbox by a broker that failed to start (%v)", n, err)
			}
		})
	}
}

// A batch heartbeat that renewed nothing because Redis is down is one 503 clients retry, not a 200
// whose every item failed.
func TestBatchHeartbeatsWithoutRedis(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "beating"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.Heartbeats(ctx, []string{"beating"}); err != nil { // the key is cached now
		t.Fatal(err)
	}
	b.Redis.Kill()
	res, err := b.Client.Heartbeats(ctx, []string{"beating", "other"})
	if code(err) != protocol.CodeUnavailable {
		t.Fatalf("batch heartbeat without Redis: %v %+v, want 503 unavailable", err, res)
	}
}

// docs/openapi.yaml names every error code of package protocol, and no other: the spec's enum is
// what each answer the tests see is checked against, so a code added without its documentation
// fails here, and one that reaches a client undocumented fails the test that met it. (unreachable
// is the SDK's own, for a broker it could not reach: no broker answers it.)
func TestErrorCodesMatchOpenAPI(t *testing.T) {
	spec, err := servertest.LoadSpec()
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, "../protocol", func(fi fs.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
	if err != nil {
		t.Fatal(err)
	}
	var codes []string
	for _, f := range pkgs["protocol"].Files {
		for _, decl := range f.Decls {
			gen, ok := decl.(*ast.GenDecl)
			if !ok || gen.Tok != token.CONST {
				continue
			}
			for _, s := range gen.Specs {
				vs := s.(*ast.ValueSpec)
				for i, name := range vs.Names {
					if !strings.HasPrefix(name.Name, "Code") || i >= len(vs.Values) {
						continue
					}
					if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
						if v, _ := strconv.Unquote(lit.Value); v != protocol.CodeUnreachable {
							codes = append(codes, v)
						}
					}
				}
			}
		}
	}
	slices.Sort(codes)
	if got := spec.ErrorCodes(); !slices.Equal(got, codes) {
		t.Errorf("docs/openapi.yaml's ErrorBody codes differ from package protocol's\nspec:     %v\nprotocol: %v", got, codes)
	}
}

// The per-source connection cap answers 429 on any route, before the request is read (the
// TooManyRequests response says so): every route documents that 429, in the shape it has.
func TestConnectionCapAnswersMatchOpenAPI(t *testing.T) {
	t.Parallel()
	spec, err := servertest.LoadSpec()
	if err != nil {
		t.Fatal(err)
	}
	b := servertest.New(t, servertest.Options{ConnsPerSource: 1})
	addr := strings.TrimPrefix(b.URL, "http://")
	held, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	// The held connection counts once the broker has answered on it.
	if _, err := io.WriteString(held, "GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if resp, err := http.ReadResponse(bufio.NewReader(held), nil); err != nil || resp.StatusCode != 200 {
		t.Fatalf("the held connection: %v %v", resp, err)
	}
	// The refusal is the same whatever the request: it is written once the request's head has
	// arrived, without handling it.
	refused, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer refused.Close()
	refused.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(refused, "GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(refused), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("past the connection cap: %d %s, want 429", resp.StatusCode, body)
	}
	for _, op := range spec.Operations() {
		method, path, _ := strings.Cut(op, " ")
		if method == http.MethodHead {
			continue // the refusal is written before the request is read: its GET's stands for it
		}
		path = strings.NewReplacer("{ref}", "doc", "{jti}", "x").Replace(path)
		if err := spec.CheckResponse(method, path, resp.StatusCode, resp.Header.Get("Content-Type"), body); err != nil {
			t.Errorf("%s past the connection cap: %v", op, err)
		}
	}
}
