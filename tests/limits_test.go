package tests

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// admin runs a `broker` admin command against this broker's data dir (its embedded Redis).
func (b *broker) admin(args ...string) (string, string, int) {
	b.t.Helper()
	cmd := exec.Command(filepath.Join(bin, "broker"), append(args, "--data-dir", b.DataDir)...)
	cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "XDG_DATA_HOME=")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		b.t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

// An operator sets an org's limits with `broker orgs set-limits`, the owner sees them with
// `sbctl limits`, a create past max_running exits 7 with a message that says how to raise it, and
// /metrics counts the refusal and the org's running sandboxes for the operator who holds the
// metrics token, and names no org to anyone else.
func TestOrgLimitsThroughTheCLIs(t *testing.T) {
	t.Parallel()
	tokenFile := filepath.Join(t.TempDir(), "metrics-token")
	const token = "0123456789abcdef0123456789abcdef"
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	b := startBroker(t, "--org-max-running", "1", "--metrics-token-file", tokenFile)

	var lim protocol.LimitsResponse
	if err := json.Unmarshal([]byte(b.ok("limits", "-o", "json")), &lim); err != nil || lim.Org != "default" ||
		lim.Limits.MaxRunning != 1 || lim.Limits.RPS != 100 || lim.Limits.Burst != 200 || len(lim.Own) != 0 {
		t.Fatalf("the defaults: %v %+v", err, lim)
	}
	if _, stderr, code := b.admin("orgs", "set-limits", "nosuch", "--max-running", "3"); code == 0 || !strings.Contains(stderr, "broker keys create --org nosuch") {
		t.Fatalf("set-limits of an unknown org: exit %d %q", code, stderr)
	}
	if _, stderr, code := b.admin("orgs", "set-limits", "default", "--max-running", "-2"); code == 0 || !strings.Contains(stderr, "0 (no limit)") {
		t.Fatalf("a negative limit: exit %d %q", code, stderr)
	}
	out, stderr, code := b.admin("orgs", "set-limits", "default", "--max-running", "2", "--rps", "50")
	if code != 0 || !strings.Contains(out, "max_running    2") {
		t.Fatalf("set-limits: exit %d\n%s%s", code, out, stderr)
	}
	b.ok("create", "one")
	b.ok("create", "two")
	r := b.sbctl("create", "three")
	if r.code != 7 || !strings.Contains(r.stderr, "broker orgs set-limits default --max-running") {
		t.Fatalf("create past max_running: exit %d %q", r.code, r.stderr)
	}
	table := b.ok("limits")
	for _, want := range []string{"org default", "max_running    2      2       org", "max_sandboxes  1000   2       default", "rps            50", "burst          200", "default"} {
		if !strings.Contains(table, want) {
			t.Errorf("sbctl limits lacks %q:\n%s", want, table)
		}
	}
	if y := b.ok("limits", "-o", "yaml"); !strings.Contains(y, "max_running: 2") || !strings.Contains(y, "running: 2") {
		t.Errorf("sbctl limits -o yaml:\n%s", y)
	}
	got, _, code := b.admin("orgs", "get-limits", "default", "-o", "json")
	if err := json.Unmarshal([]byte(got), &lim); err != nil || code != 0 || lim.Usage.Running != 2 || lim.Limits.RPS != 50 ||
		strings.Join(lim.Own, ",") != "max_running,rps" {
		t.Fatalf("get-limits: exit %d %v %+v", code, err, lim)
	}
	// Back to the default: "default" drops the org's own.
	if _, stderr, code := b.admin("orgs", "set-limits", "default", "--rps", "default"); code != 0 {
		t.Fatalf("set-limits --rps default: %s", stderr)
	}
	if err := json.Unmarshal([]byte(b.ok("limits", "-o", "json")), &lim); err != nil || lim.Limits.RPS != 100 || strings.Join(lim.Own, ",") != "max_running" {
		t.Fatalf("after --rps default: %v %+v", err, lim)
	}

	resp, err := http.Get(b.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Contains(string(metrics), `org="default"`) {
		t.Errorf("/metrics without the metrics token names the org:\n%s", metrics)
	}
	req, _ := http.NewRequest(http.MethodGet, b.URL+"/metrics", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	if resp, err = http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	}
	metrics, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`sbx_limit_refusals_total{limit="max_running",org="default"} 1`, `sbx_org_running_sandboxes{org="default"} 2`} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}
