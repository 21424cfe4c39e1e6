package main

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/sbxbroker/broker/sandbox/provider"
)

// Every invalid setting is reported with its flag and environment variable, all at once.
func TestValidateNamesTheSetting(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_LISTEN", "nonsense")
	t.Setenv("SBX_PROVIDER", "docker")
	t.Setenv("SBX_DISK_RESERVE", "lots")
	cmd.SetArgs([]string{"--log-format", "xml", "--default-ttl", "48h", "--max-ttl", "24h", "--retention", "30s", "--redis-timeout", "0s", "--data-dir", t.TempDir()})
	err := cmd.Execute()
	if err == nil {
		t.Fatal("want a configuration error")
	}
	for _, want := range []string{"--listen (SBX_LISTEN)", "--provider (SBX_PROVIDER)", "--log-format (SBX_LOG_FORMAT)",
		"--default-ttl (SBX_DEFAULT_TTL)", "--retention (SBX_RETENTION)", "--redis-timeout (SBX_REDIS_TIMEOUT)", "--disk-reserve (SBX_DISK_RESERVE)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

func TestEnvFallbackAndFlagPrecedence(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_SWEEP_INTERVAL", "5s")
	t.Setenv("SBX_DEFAULT_TTL", "10m")
	if err := cmd.ParseFlags([]string{"--default-ttl", "20m"}); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(cmd); err != nil {
		t.Fatal(err)
	}
	sweep, _ := cmd.Flags().GetDuration("sweep-interval")
	ttl, _ := cmd.Flags().GetDuration("default-ttl")
	if sweep != 5*time.Second || ttl != 20*time.Minute {
		t.Fatalf("env fills unset flags, flags win: sweep %s ttl %s", sweep, ttl)
	}
	t.Setenv("SBX_MAX_TTL", "forever")
	if err := applyEnv(rootCmd()); err == nil || !strings.Contains(err.Error(), "SBX_MAX_TTL") {
		t.Fatalf("a bad env value must name the variable: %v", err)
	}
}

// --advertise-url is checked and normalised by the one base-URL rule: a scheme in capitals is
// still http(s), and the dataplane URLs built from it are ws(s)://, never ws://HTTPS://.
func TestAdvertiseURLIsNormalised(t *testing.T) {
	for in, want := range map[string]string{
		"HTTPS://broker.example:8443/": "https://broker.example:8443",
		"Http://10.0.0.5:7070":         "http://10.0.0.5:7070",
	} {
		c := &config{AdvertiseURL: in}
		if got := c.advertise(); got != want {
			t.Errorf("--advertise-url %s: advertised %q, want %q", in, got, want)
		}
	}
	for _, in := range []string{"ws://b:1", "http://user:pw@b", "http://b/prefix", "http://b?q=1", "b:7070"} {
		cmd := rootCmd()
		cmd.SetArgs([]string{"--advertise-url", in, "--data-dir", t.TempDir()})
		if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "--advertise-url (SBX_ADVERTISE_URL)") {
			t.Errorf("--advertise-url %s: %v, want a configuration error naming it", in, err)
		}
	}
}

// The dataplane connection caps take their SBX_* fallbacks and refuse nonsense by name.
func TestDataplaneConnectionCapFlags(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_MAX_DATAPLANE_CONNECTIONS_PER_ORG", "12")
	if err := cmd.ParseFlags([]string{"--max-dataplane-connections-per-credential", "3"}); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(cmd); err != nil {
		t.Fatal(err)
	}
	if streams, _ := cmd.Flags().GetInt("max-event-streams-per-key"); streams != 256 {
		t.Fatalf("--max-event-streams-per-key defaults to %d, want 256", streams)
	}
	org, _ := cmd.Flags().GetInt("max-dataplane-connections-per-org")
	cred, _ := cmd.Flags().GetInt("max-dataplane-connections-per-credential")
	all, _ := cmd.Flags().GetInt("max-dataplane-connections")
	if org != 12 || cred != 3 || all != 4096 {
		t.Fatalf("per org %d, per credential %d, all %d; want 12, 3 and the default 4096", org, cred, all)
	}

	cmd = rootCmd()
	t.Setenv("SBX_MAX_DATAPLANE_CONNECTIONS_PER_ORG", "0")
	cmd.SetArgs([]string{"--data-dir", t.TempDir()})
	err := cmd.Execute()
	if err == nil || !strings.Contains(err.Error(), "--max-dataplane-connections-per-org (SBX_MAX_DATAPLANE_CONNECTIONS_PER_ORG)") {
		t.Fatalf("want a configuration error naming the setting: %v", err)
	}
	cmd = rootCmd()
	t.Setenv("SBX_MAX_DATAPLANE_CONNECTIONS_PER_ORG", "")
	cmd.SetArgs([]string{"--data-dir", t.TempDir(), "--max-event-streams-per-key", "0"})
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "--max-event-streams-per-key (SBX_MAX_EVENT_STREAMS_PER_KEY)") {
		t.Fatalf("want a configuration error naming --max-event-streams-per-key: %v", err)
	}
}

// --disk-reserve: unset is the provider's default (0), "0" turns the check off (-1), a size is that.
func TestDiskReserveFlag(t *testing.T) {
	for in, want := range map[string]provider.ByteSize{"": 0, "0": -1, "2GiB": 2 << 30} {
		if got := (&config{DiskReserve: in}).diskReserve(); got != want {
			t.Errorf("--disk-reserve %q: %d, want %d", in, got, want)
		}
	}
}

// --sandbox-uids takes FIRST-LAST or shared, never a range holding root, nobody or a host user,
// and never hands out --sandbox-uid, the uid sandboxes shared before.
func TestSandboxUIDsSetting(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want string // "" = valid
	}{
		{v: "100000-165535"},
		{v: "shared"},
		{v: "200000-200000"},
		{v: "abc", want: "is not FIRST-LAST"},
		{v: "100-50000", want: "at least 1000"},
		{v: "300000-200000", want: "first to last"},
		{v: "60000-70000", want: "nobody"},
	} {
		cmd := rootCmd()
		t.Setenv("SBX_SANDBOX_UIDS", tc.v)
		cmd.SetArgs([]string{"--listen", "nonsense", "--data-dir", t.TempDir()})
		err := cmd.Execute()
		hasErr := err != nil && strings.Contains(err.Error(), "--sandbox-uids (SBX_SANDBOX_UIDS)")
		switch {
		case tc.want == "" && hasErr:
			t.Errorf("%q: %v", tc.v, err)
		case tc.want != "" && (!hasErr || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%q: %v, want an error saying %q", tc.v, err, tc.want)
		}
	}
	r, err := parseUIDRange("100000-100009")
	if err != nil || r.First != 100000 || r.Last != 100009 {
		t.Fatal(r, err)
	}
}

func TestSandboxUIDsNotAHostUser(t *testing.T) {
	f := t.TempDir() + "/passwd"
	if err := os.WriteFile(f, []byte("root:x:0:0::/root:/bin/sh\nalice:x:100005:100005::/home/alice:/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if name, id := firstIDIn(f, 100000, 165535); name != "alice" || id != 100005 {
		t.Fatalf("firstIDIn: %q %d, want alice 100005", name, id)
	}
	if name, _ := firstIDIn(f, 200000, 265535); name != "" {
		t.Fatalf("firstIDIn found %q outside the range", name)
	}
}

// --kube-agent-from is checked at start: an entry that is neither an address nor a pod label is
// named with its flag and variable, never turned into a policy that admits nothing or everything.
func TestKubeAgentFromIsChecked(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_KUBE_AGENT_FROM", "10.0.0.0/8,the-brokers")
	cmd.SetArgs([]string{"--provider", "kubernetes", "--kube-image", "sbx.local/sandbox:1", "--data-dir", t.TempDir()})
	err := cmd.Execute()
	if err == nil || !strings.Contains(err.Error(), "--kube-agent-from (SBX_KUBE_AGENT_FROM)") || !strings.Contains(err.Error(), `"the-brokers"`) {
		t.Fatalf("want the bad entry named: %v", err)
	}
}

// A metrics token file is read once and kept as a hash; a short, multi-line or missing one stops
// the broker at start with a message that never repeats the token.
func TestReadMetricsToken(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := dir + "/" + name
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if h, err := readMetricsToken(""); h != nil || err != nil {
		t.Fatalf("no file: %x %v", h, err)
	}
	good := "tok-" + strings.Repeat("9", 28)
	h, err := readMetricsToken(write("good", good+"\n"))
	if err != nil || len(h) != 32 {
		t.Fatalf("good token: %x %v", h, err)
	}
	for name, content := range map[string]string{
		"short": "s3cr3t-short", "two-words": "abcdefgh ijklmnopqrstu", "escape": "abcdefgh\x1b[2Jijklmnopq",
		"huge": strings.Repeat("x", 5000),
	} {
		_, err := readMetricsToken(write(name, content))
		if err == nil || strings.Contains(err.Error(), content[:8]) && name != "huge" {
			t.Errorf("%s: %v, want a refusal that does not echo the token", name, err)
		}
	}
	if _, err := readMetricsToken(dir + "/missing"); err == nil || !strings.Contains(err.Error(), "--metrics-token-file") {
		t.Errorf("missing file: %v", err)
	}
}

// Every command's help shows an example, and every flag's help shows its value as its type (string, int, duration ...): pflag takes a
// `backquoted` word in a usage as the value's name, so "(`broker orgs set-limits` sets ...)" made
// --help print "--org-max-running broker orgs set-limits" as if that were the value to type.
func TestHelpShowsExamplesAndValueTypes(t *testing.T) {
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if c.Runnable() && c.Example == "" && c.Name() != "help" && c.Name() != "completion" && (c.Parent() == nil || c.Parent().Name() != "completion") {
			t.Errorf("%s: no example in its help", c.CommandPath())
		}
		c.Flags().VisitAll(func(f *pflag.Flag) {
			if _, ok := envOf[f.Name]; !ok && f.Name != "help" && f.Name != "version" && c.Parent() == nil {
				t.Errorf("--%s has no SBX_* environment fallback", f.Name)
			}
			name, _ := pflag.UnquoteUsage(f)
			if name != "" && name != f.Value.Type() && !(f.Value.Type() == "stringSlice" && name == "strings") {
				t.Errorf("%s --%s: help shows its value as %q, not its type %q", c.CommandPath(), f.Name, name, f.Value.Type())
			}
		})
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(rootCmd())
}
