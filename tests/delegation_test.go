package tests

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tests/wait"
)

// The delegation flow as a person runs it: delegate, introspect, revoke, introspect; run-config
// in every format; one sandbox per thread.
func TestDelegationThroughSbctl(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "dev")

	var mint protocol.MintResponse
	if err := json.Unmarshal([]byte(b.ok("delegate", "dev", "--scope", "fs:read,exec", "--allow-cmd", "pytest", "--expires", "10m", "-o", "json")), &mint); err != nil {
		t.Fatal(err)
	}
	if mint.Sandbox.Credential != mint.Token || !strings.HasSuffix(mint.Sandbox.DataplaneURL, "/v1/sandboxes/"+mint.Sandbox.SandboxID+"/dataplane") {
		t.Fatalf("block: %+v", mint.Sandbox)
	}
	if d := time.Until(mint.ExpiresAt); d < 9*time.Minute || d > 11*time.Minute {
		t.Fatalf("expiry %s", mint.ExpiresAt)
	}
	// The token goes to introspection on stdin, so it stays out of argv.
	if out := b.sbctlIn(mint.Token+"\n", "introspect", "-"); out.code != 0 || !strings.HasPrefix(out.stdout, "active: sandbox "+mint.Sandbox.SandboxID) || !strings.Contains(out.stdout, "fs:read,exec") {
		t.Fatalf("introspect: %+v", out)
	}
	list := b.ok("delegations", "dev")
	if !strings.Contains(list, mint.JTI) || !strings.Contains(list, "pytest") || strings.Contains(list, mint.Token) {
		t.Fatalf("delegations:\n%s", list)
	}
	if got := b.ok("revoke", "dev", "--jti", mint.JTI); !strings.Contains(got, "revoked token "+mint.JTI) {
		t.Fatalf("revoke: %q", got)
	}
	if out := b.sbctlIn(mint.Token, "introspect", "-o", "json"); !strings.Contains(out.stdout, `"active": false`) || !strings.Contains(out.stdout, "token_revoked") {
		t.Fatalf("introspect after revoke: %+v", out)
	}
	if r := b.sbctl("revoke", "dev"); r.code != 2 {
		t.Fatalf("revoke without --jti or --all: %+v", r)
	}

	var rc protocol.RunConfig
	raw := b.ok("run-config", "dev")
	if err := json.Unmarshal([]byte(raw), &rc); err != nil {
		t.Fatalf("run-config is not JSON: %v\n%s", err, raw)
	}
	var generic map[string]map[string]map[string]map[string]string
	json.Unmarshal([]byte(raw), &generic)
	blk := generic["config"]["configurable"]["sandbox"]
	if len(blk) != 4 || blk["sandbox_id"] == "" || blk["credential"] == "" || blk["dataplane_url"] == "" ||
		blk["mcp_url"] != strings.Replace(strings.Replace(blk["dataplane_url"], "ws://", "http://", 1), "/dataplane", "/mcp", 1) {
		t.Fatalf("run-config block must have exactly the four keys, mcp_url beside dataplane_url: %s", raw)
	}
	var bare map[string]string
	json.Unmarshal([]byte(b.ok("run-config", "dev", "--format", "block")), &bare)
	if len(bare) != 4 || bare["sandbox_id"] != blk["sandbox_id"] {
		t.Fatalf("block format: %v", bare)
	}
	env := b.ok("run-config", "dev", "--format", "env")
	for _, k := range []string{"SBX_SANDBOX_ID=", "SBX_SANDBOX_CREDENTIAL=", "SBX_DATAPLANE_URL=", "SBX_MCP_URL="} {
		if !strings.Contains(env, "export "+k) {
			t.Fatalf("env format lacks %s:\n%s", k, env)
		}
	}

	// One sandbox per thread, however often the client asks.
	first := b.sbctl("run-config", "--thread", "3f6c0e8e-5d1b-4c9a-9d7e-21a0f3b2c4d5")
	second := b.sbctl("run-config", "--thread", "3f6c0e8e-5d1b-4c9a-9d7e-21a0f3b2c4d5")
	if first.code != 0 || second.code != 0 || !strings.Contains(first.stderr, "created") || !strings.Contains(second.stderr, "reused") {
		t.Fatalf("run-config --thread: %+v %+v", first, second)
	}
	var one, two protocol.RunConfig
	json.Unmarshal([]byte(first.stdout), &one)
	json.Unmarshal([]byte(second.stdout), &two)
	if one.Config.Configurable.Sandbox.SandboxID != two.Config.Configurable.Sandbox.SandboxID {
		t.Fatal("two run-configs for one thread gave two sandboxes")
	}
	if ids := b.ok("list", "--tag", "thread_id=3f6c0e8e-5d1b-4c9a-9d7e-21a0f3b2c4d5", "-q"); strings.Count(ids, "sb_") != 1 {
		t.Fatalf("thread sandboxes: %q", ids)
	}
}

// sbctl exec streams output and exits with the command's code; events show what happened.
func TestExecAndEventsThroughSbctl(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "box")
	if out := b.ok("exec", "box", "-c", "echo hello > greeting.txt && cat greeting.txt"); out != "hello\n" {
		t.Fatalf("exec: %q", out)
	}
	r := b.sbctl("exec", "box", "--", "sh", "-c", "echo to-stderr >&2; exit 3")
	if r.code != 3 || r.stderr != "to-stderr\n" {
		t.Fatalf("exit code passthrough: %+v", r)
	}
	if out := b.sbctlIn("print-me", "exec", "box", "-i", "--", "cat"); out.stdout != "print-me" {
		t.Fatalf("stdin: %+v", out)
	}
	// A cwd the path rules refuse is the caller's mistake: exit 2, naming the flag.
	if r := b.sbctl("exec", "box", "--cwd", "/etc", "--", "true"); r.code != 2 || !strings.Contains(r.stderr, "--cwd") || !strings.Contains(r.stderr, "outside /workspace") {
		t.Fatalf("cwd escape: %+v", r)
	}
	// The events of a pane: created, connected, exec with exit code.
	var lines []protocol.Event
	for _, l := range strings.Split(strings.TrimSpace(b.ok("events", "box", "-o", "json", "--backlog", "100")), "\n") {
		var e protocol.Event
		if err := json.Unmarshal([]byte(l), &e); err != nil {
			t.Fatalf("events -o json line %q: %v", l, err)
		}
		lines = append(lines, e)
	}
	var sawCreated, sawExec3 bool
	for _, e := range lines {
		sawCreated = sawCreated || e.Type == "created"
		sawExec3 = sawExec3 || (e.Type == "exec" && e.ExitCode != nil && *e.ExitCode == 3)
	}
	if !sawCreated || !sawExec3 {
		t.Fatalf("events: %+v", lines)
	}
	table := b.ok("events", "box", "--backlog", "100")
	if !strings.Contains(table, "exec") || !strings.Contains(table, "-> exit 3") {
		t.Fatalf("events table:\n%s", table)
	}

	// sbctl events -f follows: from the last event seen (--since), so the exec below is shown
	// whenever the stream opens, with no wait for it to open first.
	since := lines[len(lines)-1].ID
	if since == "" {
		t.Fatalf("events -o json printed no id: %+v", lines[len(lines)-1])
	}
	cmd := exec.Command(filepath.Join(bin, "sbctl"), "events", "box", "-f", "--since", since, "-o", "json")
	cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	b.ok("exec", "box", "--", "true")
	got := make(chan string, 8)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			got <- sc.Text()
		}
	}()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case l := <-got:
			if strings.Contains(l, `"type":"exec"`) && strings.Contains(l, `"command":"true"`) {
				cmd.Process.Signal(syscall.SIGINT)
				if err := cmd.Wait(); err != nil {
					t.Fatalf("events -f did not exit cleanly on SIGINT: %v", err)
				}
				return
			}
		case <-deadline:
			t.Fatal("events -f did not show the exec")
		}
	}
}

// sbctl attach keeps the lease, exits cleanly on Ctrl-C, and can stop the sandbox on exit.
func TestAttach(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "leased", "--ttl", "3s")
	cmd := exec.Command(filepath.Join(bin, "sbctl"), "attach", "leased", "--stop-on-exit")
	cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Beats every second keep a 3 s lease alive well past 3 s; the broker's sweeper runs every 2 s.
	// Wait until a beat at least 5 s after the create has moved the lease (without attach it would
	// have been stopped by then, and its lease would never move).
	wait.Eventually(t, 20*time.Second, func() bool {
		var sb protocol.Sandbox
		if err := json.Unmarshal([]byte(b.ok("get", "leased", "-o", "json")), &sb); err != nil {
			t.Fatalf("get -o json: %v", err)
		}
		return sb.ExpiresAt != nil && sb.ExpiresAt.Sub(sb.CreatedAt) >= 8*time.Second
	}, "attach renewed the lease of leased 5 s after its create\nattach said:\n%s", &stderr)
	if got := b.ok("get", "leased"); !strings.Contains(got, "running") {
		t.Fatalf("attached sandbox not running after 5 s:\n%s\nattach said:\n%s", got, stderr.String())
	}
	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("attach exit: %v\n%s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "lease renewed") || !strings.Contains(stderr.String(), "stopped leased") {
		t.Fatalf("attach output:\n%s", stderr.String())
	}
	if got := b.ok("get", "leased"); !strings.Contains(got, "stopped (requested)") {
		t.Fatalf("--stop-on-exit: %s", got)
	}
	// Without attach, the 3 s lease runs out and the sweeper stops it (files kept).
	b.ok("resume", "leased")
	wait.Eventually(t, 15*time.Second, func() bool { return strings.Contains(b.ok("get", "leased"), "ttl_expired") }, "the lease of leased ran out")
	if dry := b.ok("sweep", "--dry-run"); !strings.Contains(dry, "leased") || !strings.Contains(dry, "ttl_expired") {
		t.Fatalf("sweep --dry-run:\n%s", dry)
	}
}

// The admin commands work against a running broker's embedded Redis; a rotation keeps old tokens
// valid and publishes both keys.
func TestAdminCommands(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	admin := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(filepath.Join(bin, "broker"), append(args, "--data-dir", b.DataDir)...)
		cmd.Env = append(os.Environ(), "HOME="+b.Home)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("broker %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	key := strings.TrimSpace(admin("keys", "create", "--org", "acme", "--name", "ci", "-o", "key"))
	if !strings.HasPrefix(key, "sbk_") {
		t.Fatalf("key: %q", key)
	}
	if r := b.sbctl("list", "--api-key", key); r.code != 0 {
		t.Fatalf("new key does not work: %+v", r)
	}
	list := admin("keys", "list")
	if !strings.Contains(list, "acme") || strings.Contains(list, key) {
		t.Fatalf("keys list:\n%s", list)
	}
	var id string
	for _, l := range strings.Split(list, "\n") {
		if strings.Contains(l, "acme") {
			id = strings.Fields(l)[0]
		}
	}
	// A token the key minted ends with it; the org's other key sees it inactive.
	other := strings.TrimSpace(admin("keys", "create", "--org", "acme", "--name", "ci2", "-o", "key"))
	if r := b.sbctl("create", "acme-dev", "--api-key", key); r.code != 0 {
		t.Fatalf("create with the new key: %+v", r)
	}
	var minted protocol.MintResponse
	if r := b.sbctl("delegate", "acme-dev", "--scope", "exec", "-o", "json", "--api-key", key); r.code != 0 || json.Unmarshal([]byte(r.stdout), &minted) != nil {
		t.Fatalf("delegate with the new key: %+v", r)
	}
	if out := b.sbctlIn(minted.Token, "introspect", "-", "--api-key", other); !strings.HasPrefix(out.stdout, "active") {
		t.Fatalf("introspect before the key's revocation: %+v", out)
	}
	if got := admin("keys", "revoke", id); !strings.Contains(got, "every delegation token it minted") {
		t.Fatalf("keys revoke: %q", got)
	}
	if r := b.sbctl("list", "--api-key", key); r.code != 4 {
		t.Fatalf("revoked key still works: %+v", r)
	}
	if out := b.sbctlIn(minted.Token, "introspect", "-", "-o", "json", "--api-key", other); !strings.Contains(out.stdout, `"active": false`) || !strings.Contains(out.stdout, "token_revoked") {
		t.Fatalf("a token of a revoked key, introspected: %+v", out)
	}

	b.ok("create", "rot")
	var before protocol.MintResponse
	json.Unmarshal([]byte(b.ok("delegate", "rot", "--scope", "exec", "-o", "json")), &before)
	admin("keys", "rotate-signing")
	// The running broker picks the new key up within its reload interval.
	wait.Eventually(t, 20*time.Second, func() bool {
		var after protocol.MintResponse
		json.Unmarshal([]byte(b.ok("delegate", "rot", "--scope", "exec", "-o", "json")), &after)
		return kid(after.Token) != kid(before.Token)
	}, "new tokens carry the new kid after rotate-signing")
	if out := b.sbctlIn(before.Token, "introspect"); !strings.HasPrefix(out.stdout, "active") {
		t.Fatalf("a token signed before the rotation stopped verifying: %+v", out)
	}
	resp, err := http.Get(b.URL + "/.well-known/jwks.json")
	if err != nil {
		t.Fatal(err)
	}
	var set struct{ Keys []struct{ Kid string } }
	json.NewDecoder(resp.Body).Decode(&set)
	resp.Body.Close()
	if len(set.Keys) != 2 {
		t.Fatalf("JWKS after rotation: %+v", set)
	}
}

func kid(token string) string {
	h, _ := base64.RawURLEncoding.DecodeString(strings.Split(token, ".")[0])
	var hdr struct{ Kid string }
	json.Unmarshal(h, &hdr)
	return hdr.Kid
}
