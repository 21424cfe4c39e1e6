package provider

import (
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadTemplates(t *testing.T) {
	kb := t.TempDir()
	want := Template{
		Name:    "py",
		Rootfs:  kb,
		Mounts:  []Mount{{Source: kb, Target: "/opt/kb"}},
		Env:     map[string]string{"PYTHONUNBUFFERED": "1"},
		Network: NetworkOn,
		Limits:  Limits{MemoryBytes: 1 << 30, Pids: 256, CPUs: 1.5, ExecTimeout: Duration(30 * time.Second), ExecTimeoutMax: Duration(10 * time.Minute)},
		Setup:   "pip install -r requirements.txt",
		Disk:    2 << 30,
		Tmp:     256 << 20,
		Pool:    Pool{Size: 3},
	}
	body := `
  rootfs: ` + kb + `
  mounts:
    - source: ` + kb + `
      target: /opt/kb
  env:
    PYTHONUNBUFFERED: "1"
  network: true
  limits:
    memory_bytes: 1073741824
    pids: 256
    cpus: 1.5
    exec_timeout: 30s
    exec_timeout_max: 10m
  setup: pip install -r requirements.txt
  disk: 2GiB
  tmp: 256MiB
  pool: {size: 3}
`
	jsonBody, _ := json.Marshal([]Template{want})
	for name, content := range map[string]string{
		"list.yaml": "- name: py" + body,
		"map.yaml":  "py:" + strings.ReplaceAll(body, "\n  ", "\n    ") + "\n",
		"list.json": string(jsonBody),
	} {
		t.Run(name, func(t *testing.T) {
			got, err := LoadTemplates(writeFile(t, name, content))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got["py"], want) {
				t.Errorf("got %+v\nwant %+v", got["py"], want)
			}
			if _, ok := got[DefaultTemplateName]; !ok || len(got) != 2 {
				t.Errorf("templates %v: want py and the built-in default", got)
			}
		})
	}
	t.Run("a file may override default", func(t *testing.T) {
		got, err := LoadTemplates(writeFile(t, "t.yaml", "default:\n  env:\n    A: b\n"))
		if err != nil || got["default"].Env["A"] != "b" {
			t.Fatal(got, err)
		}
	})
	t.Run("empty file", func(t *testing.T) {
		got, err := LoadTemplates(writeFile(t, "t.yaml", ""))
		if err != nil || len(got) != 1 {
			t.Fatal(got, err)
		}
	})
}

func TestLoadTemplatesErrors(t *testing.T) {
	dir := t.TempDir()
	file := writeFile(t, "f", "x")
	for _, tc := range []struct{ content, want string }{
		{"- name: a\n  bogus: 1\n", `template "a": unknown field "bogus"`},
		{"- name: a\n  disk: 2 GB please\n", `template "a": size "2 GB please"`},
		{"- name: a\n  disk: 1MiB\n", `template "a": disk 1MiB: must be at least 8MiB`},
		{"a:\n  limits:\n    bogus: 1\n", `template "a": unknown field "bogus"`},
		{"- env: {}\n", "template #1: name: required"},
		{"- name: a/b\n", `template "a/b": name "a/b"`},
		{"- name: a\n  rootfs: /does/not/exist\n", `template "a": rootfs: stat /does/not/exist`},
		{"- name: a\n  rootfs: relative\n", `template "a": rootfs "relative": must be an absolute path`},
		{"- name: a\n  rootfs: " + file + "\n", `template "a": rootfs: ` + file + " is not a directory"},
		{"- name: a\n  mounts: [{source: /does/not/exist, target: /x}]\n", `template "a": mounts[0].source: stat /does/not/exist`},
		{"- name: a\n  mounts: [{source: " + dir + ", target: relative}]\n", `template "a": mounts[0].target "relative": must be an absolute path`},
		{"- name: a\n  mounts: [{source: " + dir + ", target: /workspace/kb}]\n", `mounts[0].target "/workspace/kb": must not be under /workspace`},
		{"- name: a\n  mounts: [{source: " + dir + ", target: /proc}]\n", "must not be under /proc"},
		{"- name: a\n  mounts: [{source: " + dir + ", target: /dev/x}]\n", "must not be under /dev"},
		{"- name: a\n  mounts: [{source: " + dir + ", target: /}]\n", "mounts[0].target: cannot be /"},
		{"- name: a\n  limits: {pids: -1}\n", `template "a": limits: pids must not be negative`},
		{"- name: a\n  limits: {memory_bytes: -1}\n", "memory_bytes must not be negative"},
		{"- name: a\n  limits: {exec_timeout: 2h, exec_timeout_max: 1h}\n", "exec_timeout must not exceed exec_timeout_max"},
		{"- name: a\n  limits: {exec_timeout: 30}\n", `duration must be a string`},
		{"- name: a\n  limits: {exec_timeout: soon}\n", `duration "soon"`},
		{"- name: a\n  limits: {pids: many}\n", "field limits.pids"},
		{"- name: a\n  env: {1BAD: x}\n", `env "1BAD": not a valid variable name`},
		{"- name: a\n- name: a\n", `template "a" is defined twice`},
		{"a:\n  name: b\n", `name "b" differs from its key`},
		{"just a string\n", "want a list of templates or a map"},
		{"a: 1\na: 2\n", `key "a" already set`},
		{"- name: a\n  network: {allow: []}\n", "network: allow is empty"},
		{"- name: a\n  network: {allow: [example.com:443]}\n", `network.allow[0] "example.com:443": want an IP address or CIDR prefix (host names are not supported`},
		{"- name: a\n  network: {allow: [10.0.0.0/33]}\n", `network.allow[0] "10.0.0.0/33"`},
		{"- name: a\n  network: {allow: [\"10.0.0.1:0\"]}\n", "port: want a number 1-65535"},
		{"- name: a\n  network: {allow: [\"10.0.0.1:90-80\"]}\n", "port: want a number 1-65535 or a range"},
		{"- name: a\n  network: {allow: [\"[2001:db8::1:443\"]}\n", "missing ']'"},
		{"- name: a\n  network: {deny: [10.0.0.0/8]}\n", `network: want true, false or {allow:`},
		{"- name: a\n  pool: {size: -1}\n", `template "a": pool.size -1: must be between 0 and 32`},
		{"- name: a\n  pool: {size: 33}\n", "pool.size 33: must be between 0 and 32"},
		{"- name: a\n  pool: {size: 1, warm: yes}\n", `unknown field "warm"`},
		{"- name: a\n  network: yes please\n", `network: want true, false or {allow:`},
	} {
		_, err := LoadTemplates(writeFile(t, "t.yaml", tc.content))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want it to contain %q", tc.content, err, tc.want)
		}
	}
	if _, err := LoadTemplates(filepath.Join(dir, "missing.yaml")); err == nil {
		t.Error("missing file: no error")
	}
}

// network: keeps its old forms (true, false) and takes an allowlist; each round-trips.
func TestNetworkTemplate(t *testing.T) {
	for content, want := range map[string]Network{
		"network: true\n":  NetworkOn,
		"network: false\n": {},
		"env: {}\n":        {},
		"network: {allow: [\"10.0.0.0/8:443\", 192.0.2.7, \"[2001:db8::1]:8000-8999\", \"2001:db8::/32\"]}\n": {
			Enabled: true, Allow: []string{"10.0.0.0/8:443", "192.0.2.7", "[2001:db8::1]:8000-8999", "2001:db8::/32"},
		},
	} {
		got, err := LoadTemplates(writeFile(t, "t.yaml", "a:\n  "+content))
		if err != nil {
			t.Fatalf("%q: %v", content, err)
		}
		if !reflect.DeepEqual(got["a"].Network, want) {
			t.Errorf("%q: got %+v, want %+v", content, got["a"].Network, want)
		}
		b, _ := json.Marshal(got["a"])
		var back Template
		if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back.Network, want) {
			t.Errorf("%q: round trip %s: %+v %v", content, b, back.Network, err)
		}
	}
	rules, err := parseAllow([]string{"10.1.2.3/8:443", "[2001:db8::1]:8000-8999", "192.0.2.7"})
	if err != nil {
		t.Fatal(err)
	}
	want := []egressRule{
		{prefix: netip.MustParsePrefix("10.0.0.0/8"), from: 443, to: 443},
		{prefix: netip.MustParsePrefix("2001:db8::1/128"), from: 8000, to: 8999},
		{prefix: netip.MustParsePrefix("192.0.2.7/32"), from: 0, to: 65535},
	}
	if !reflect.DeepEqual(rules, want) {
		t.Errorf("parseAllow: %+v, want %+v", rules, want)
	}
}

func TestDurationJSON(t *testing.T) {
	b, err := json.Marshal(Limits{ExecTimeout: Duration(90 * time.Second)})
	if err != nil || string(b) != `{"exec_timeout":"1m30s"}` {
		t.Fatalf("%s %v", b, err)
	}
	var l Limits
	if err := json.Unmarshal([]byte(`{"exec_timeout":"10m","exec_timeout_max":"1h30m"}`), &l); err != nil {
		t.Fatal(err)
	}
	if l.ExecTimeout != Duration(10*time.Minute) || l.ExecTimeoutMax != Duration(90*time.Minute) {
		t.Errorf("%+v", l)
	}
}

func TestResolveLimits(t *testing.T) {
	got := resolveLimits(Limits{Pids: 100, ExecTimeout: Duration(time.Minute)}, Limits{MemoryBytes: 1 << 20, ExecTimeoutMax: Duration(30 * time.Second)})
	want := Limits{MemoryBytes: 1 << 20, Pids: 100, CPUs: DefaultCPUs, ExecTimeout: Duration(30 * time.Second), ExecTimeoutMax: Duration(30 * time.Second)}
	if got != want {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if got := resolveLimits(Limits{}, Limits{}); got != DefaultLimits() {
		t.Errorf("zero limits: %+v", got)
	}
}
