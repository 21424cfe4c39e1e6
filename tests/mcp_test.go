package tests

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/sbxbroker/broker/client"
)

// The MCP front end, both transports, driven by the official TypeScript MCP client
// (tests/mcp/mcp.test.mjs, @modelcontextprotocol/sdk pinned by its package-lock.json) against a
// real broker with real sandboxes: tools per scope, every tool, refusals, revoked and expired
// tokens, a sandbox stopped mid-session, concurrency, cancellation and bad input.
func TestMCPWithTypeScriptClient(t *testing.T) {
	if _, err := exec.LookPath("node"); err != nil {
		t.Fatal("node is not installed: the MCP tests run the official TypeScript client (scripts/deps.sh installs nodejs)")
	}
	dir, err := filepath.Abs("mcp")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "@modelcontextprotocol", "sdk")); err != nil {
		ci := exec.Command("npm", "ci", "--no-audit", "--no-fund")
		ci.Dir = dir
		if out, err := ci.CombinedOutput(); err != nil {
			t.Fatalf("npm ci in tests/mcp failed (%v); run it by hand:\n%s", err, out)
		}
	}
	b := startBroker(t)
	cfg, err := client.LoadConfig(filepath.Join(b.Home, ".config", "sbctl", "config.yaml"))
	if err != nil || cfg.APIKey == "" {
		t.Fatalf("the broker's bootstrap config: %v", err)
	}
	cmd := exec.Command("node", "--test", "--test-reporter=spec", "--test-concurrency=1", "--test-timeout=120000", "--test-force-exit", "mcp.test.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_BROKER_URL="+b.URL,
		"SBX_API_KEY="+cfg.APIKey, "SBCTL="+filepath.Join(bin, "sbctl"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the TypeScript MCP tests failed: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}
