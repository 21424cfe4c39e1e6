package provider

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestEtcViewFollowsTheHost: the copy changes when a source does (in place, replaced, a directory's
// entry added), a running sandbox's copy stays until it is released, and nothing the sandbox uid
// could not have reached is copied.
func TestEtcViewFollowsTheHost(t *testing.T) {
	src := testDataDir(t)
	write := func(name, content string) {
		t.Helper()
		p := filepath.Join(src, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("hosts", "a")
	write("ssl/certs/one.pem", "1")
	write("zone", "UTC")
	if err := os.Symlink(filepath.Join(src, "zone"), filepath.Join(src, "localtime")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("one.pem", filepath.Join(src, "ssl/certs/link.pem")); err != nil {
		t.Fatal(err)
	}
	write("private/os-release", "secret")
	if err := os.Chmod(filepath.Join(src, "private"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(src, "private/os-release"), filepath.Join(src, "os-release")); err != nil {
		t.Fatal(err)
	}

	v, err := newEtcView(src, testDataDir(t), os.Geteuid() == 0)
	if err != nil {
		t.Fatal(err)
	}
	read := func(dir, name string) string {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	first, releaseFirst, err := v.acquire(false)
	if err != nil {
		t.Fatal(err)
	}
	if got := read(first, "hosts") + read(first, "localtime") + read(first, "ssl/certs/link.pem"); got != "aUTC1" {
		t.Errorf("copy: %q", got)
	}
	if fi, err := os.Lstat(filepath.Join(first, "localtime")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("a top-level symlink is followed, as bwrap's bind did: %v %v", fi, err)
	}
	if fi, err := os.Lstat(filepath.Join(first, "ssl/certs/link.pem")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("a symlink below stays a link, as in the bound directory: %v %v", fi, err)
	}
	if _, err := os.Lstat(filepath.Join(first, "os-release")); err == nil {
		t.Error("copied a file behind a directory the sandbox uid cannot search")
	}
	if _, err := os.Lstat(filepath.Join(first, "resolv.conf")); err == nil {
		t.Error("the copy without the network has a resolv.conf")
	}
	net, releaseNet, err := v.acquire(true)
	if err != nil {
		t.Fatal(err)
	}
	releaseNet()
	if got := read(net, "resolv.conf") + read(net, "hosts"); got != "a" {
		t.Errorf("network copy: %q", got)
	}

	same, releaseSame, err := v.acquire(false)
	if err != nil {
		t.Fatal(err)
	}
	releaseSame()
	if same != first {
		t.Errorf("nothing changed and the copy was made again: %s, %s", same, first)
	}

	for _, change := range []struct {
		name string
		do   func()
		want func(dir string) bool
	}{
		{"edited in place", func() { write("hosts", "bb") }, func(d string) bool { return read(d, "hosts") == "bb" }},
		{"a followed link's target edited", func() { write("zone", "CET") }, func(d string) bool { return read(d, "localtime") == "CET" }},
		{"an entry added below", func() { write("ssl/certs/two.pem", "2") }, func(d string) bool { return read(d, "ssl/certs/two.pem") == "2" }},
		{"replaced", func() {
			write("hosts.new", "ccc")
			if err := os.Rename(filepath.Join(src, "hosts.new"), filepath.Join(src, "hosts")); err != nil {
				t.Fatal(err)
			}
		}, func(d string) bool { return read(d, "hosts") == "ccc" }},
	} {
		change.do()
		dir, release, err := v.acquire(false)
		if err != nil {
			t.Fatal(err)
		}
		if dir == first || !change.want(dir) {
			t.Errorf("%s: not seen by the next start (%s)", change.name, dir)
		}
		release()
	}
	// The first start still holds its copy, unchanged, until it ends.
	if got := read(first, "hosts"); got != "a" {
		t.Errorf("a running sandbox's copy changed: %q", got)
	}
	releaseFirst()
	if _, err := os.Stat(first); !os.IsNotExist(err) {
		t.Errorf("an old copy no sandbox uses is still there: %v", err)
	}
}

// TestNamespaceEtcIsTheHosts: a sandbox's /etc is the host's etcFiles, names, modes, links and
// content as the host has them, its own passwd and group, and nothing else; none of it writable.
func TestNamespaceEtcIsTheHosts(t *testing.T) {
	n := newNamespace(t, Config{})
	var names []string
	for _, f := range etcFiles {
		names = append(names, strings.TrimPrefix(f, "/etc/"))
	}
	list := strings.Join(names, " ")
	// Top-level entries as bwrap's bind showed them (followed); below, as they are.
	describe := `cd /etc && for f in ` + list + `; do [ -e $f ] || continue
	  if [ -d $f ]; then find $f/ -printf '%P %y %m %l\n' | sort; find $f/ ! -type l -printf '%P %T@\n' | sort
	    find $f/ -type f -exec sha256sum {} + | sort
	  else stat -L -c "$f %a %Y" $f; sha256sum < $f; fi; done`
	host, err := exec.Command("sh", "-c", describe).Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, network := range []bool{false, true} {
		tmpl := Template{}
		top := map[string]bool{"passwd": true, "group": true}
		if network {
			if !n.asRoot {
				continue
			}
			tmpl = Template{Name: "net", Network: NetworkOn}
			if _, err := os.Stat("/etc/resolv.conf"); err == nil {
				top["resolv.conf"] = true
			}
		}
		in, _ := startSandbox(t, n, tmpl)
		if _, inside := sh(t, in, describe); inside != string(host) {
			t.Errorf("network %v: /etc differs from the host's\ninside:\n%s\nhost:\n%s", network, inside, host)
		}
		for _, name := range names {
			if _, err := os.Stat("/etc/" + name); err == nil {
				top[strings.Split(name, "/")[0]] = true
			}
		}
		_, out := sh(t, in, "ls -A /etc")
		got := strings.Fields(out)
		if len(got) != len(top) {
			t.Errorf("network %v: /etc holds %v, want %v", network, got, top)
		}
		for _, name := range got {
			if !top[name] {
				t.Errorf("network %v: /etc/%s is visible", network, name)
			}
		}
		if res, out := sh(t, in, "echo x >> /etc/hosts || echo x >> /etc/ssl/certs/ca-certificates.crt || rm /etc/ld.so.cache || chmod 777 /etc/hosts"); res.ExitCode == 0 {
			t.Errorf("network %v: wrote to /etc: %q", network, out)
		}
	}
}

// TestNamespaceTemplateMountUnderEtc: a template may mount a directory under /etc, where bwrap
// must make the mount point, and the host's entries are still there beside it.
func TestNamespaceTemplateMountUnderEtc(t *testing.T) {
	n := newNamespace(t, Config{})
	conf := testDataDir(t)
	if err := os.WriteFile(filepath.Join(conf, "app.conf"), []byte("x=1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	in, _ := startSandbox(t, n, Template{Mounts: []Mount{{Source: conf, Target: "/etc/myapp"}}})
	if _, out := sh(t, in, "cat /etc/myapp/app.conf; test -s /etc/ld.so.cache && grep -c user: /etc/passwd"); out != "x=1\n1\n" {
		t.Errorf("inside: %q", out)
	}
	if res, out := sh(t, in, "touch /etc/evil"); res.ExitCode == 0 {
		t.Errorf("wrote to /etc: %q", out)
	}
}
