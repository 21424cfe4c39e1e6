package provider

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// buildProbe compiles testdata/syscall_probe.c with the host's gcc into the sandbox's workspace and
// returns its path inside the sandbox.
func buildProbe(t *testing.T, ws string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Fatal("gcc is required to build the syscall probe: apt-get install -y gcc")
	}
	src, err := filepath.Abs("testdata/syscall_probe.c")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(gcc, "-O1", "-o", filepath.Join(ws, "probe"), src).CombinedOutput()
	if err != nil {
		t.Fatalf("gcc syscall_probe.c: %v\n%s", err, out)
	}
	return WorkspacePath + "/probe"
}

// probeResults runs the probe on names and returns what each printed ("ok" or an errno name).
func probeResults(t *testing.T, in Instance, probe string, names ...string) map[string]string {
	t.Helper()
	res, out := sh(t, in, probe+" "+strings.Join(names, " "))
	if res.ExitCode != 0 {
		t.Fatalf("probe %v: %+v %q", names, res, out)
	}
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok {
			got[k] = v
		}
	}
	return got
}

// TestSandboxSyscallFilter is the hostile tenant's view of the kernel: what Docker's default profile
// refuses, plus io_uring, keyrings, userfaultfd, bpf, perf events, AF_VSOCK and nested user
// namespaces, is refused with EPERM, and the other ABIs of this CPU kill the process.
func TestSandboxSyscallFilter(t *testing.T) {
	n := newNamespace(t, Config{})
	in, spec := startSandbox(t, n, Template{})
	probe := buildProbe(t, n.WorkspaceDir(spec))

	t.Run("refused with EPERM", func(t *testing.T) {
		names := []string{"keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
			"io_uring_register", "userfaultfd", "bpf", "perf_event_open", "vsock", "clone_newuser",
			"unshare_user", "mount", "kexec_load"}
		got := probeResults(t, in, probe, names...)
		for _, name := range names {
			if got[name] != "EPERM" {
				t.Errorf("%s inside the sandbox: %q, want EPERM", name, got[name])
			}
		}
	})
	t.Run("clone3 says ENOSYS so libc falls back to clone, whose flags the filter sees", func(t *testing.T) {
		if got := probeResults(t, in, probe, "clone3"); got["clone3"] != "ENOSYS" {
			t.Errorf("clone3: %q, want ENOSYS", got["clone3"])
		}
	})
	t.Run("ordinary calls still work", func(t *testing.T) {
		names := []string{"fork", "inet", "unix"}
		got := probeResults(t, in, probe, names...)
		for _, name := range names {
			if got[name] != "ok" {
				t.Errorf("%s inside the sandbox: %q, want ok", name, got[name])
			}
		}
	})
	t.Run("a foreign ABI kills the process", func(t *testing.T) {
		for _, abi := range []string{"i386", "x32"} {
			res, out := sh(t, in, probe+" "+abi)
			if res.Signal != "SYS" && res.ExitCode != 128+31 {
				t.Errorf("%s syscall: %+v %q, want the process killed by SIGSYS", abi, res, out)
			}
			if strings.Contains(out, abi+" ok") {
				t.Errorf("%s syscall ran: %q", abi, out)
			}
		}
	})
	t.Run("bwrap disables user namespaces too", func(t *testing.T) {
		// The filter refuses them first; this is the second wall, on every bwrap that has it.
		args, err := n.bwrapArgs(spec, []string{"true"})
		if err != nil {
			t.Fatal(err)
		}
		if n.noUserns != slices.Contains(args, "--disable-userns") {
			t.Errorf("bwrap has --disable-userns: %v; args %v", n.noUserns, args)
		}
		if out, _ := exec.Command("bwrap", "--version").Output(); strings.Contains(string(out), "bubblewrap 0.8") && !n.noUserns {
			t.Errorf("%s: --disable-userns not used", out)
		}
	})
	t.Run("the tools a tenant would use are refused too", func(t *testing.T) {
		for _, c := range []string{
			"unshare -U true",
			"unshare -Ur true",
			"/usr/bin/python3 -c 'import socket; socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)'",
		} {
			if res, out := sh(t, in, c); res.ExitCode == 0 {
				t.Errorf("%s succeeded inside the sandbox: %q", c, out)
			} else if !strings.Contains(out, "ermission") && !strings.Contains(out, "EPERM") && !strings.Contains(out, "not permitted") {
				t.Errorf("%s failed, but not with EPERM: %q", c, out)
			}
		}
	})
}

// seccompData lays out struct seccomp_data for the x/net/bpf VM, which loads words big-endian:
// each 32-bit word sits where a little-endian kernel has it, with its bytes in the VM's order.
func seccompData(nr int, auditArch uint32, args ...uint64) []byte {
	b := make([]byte, 64)
	binary.BigEndian.PutUint32(b[0:], uint32(nr))
	binary.BigEndian.PutUint32(b[4:], auditArch)
	for i, v := range args {
		binary.BigEndian.PutUint32(b[16+8*i:], uint32(v))
		binary.BigEndian.PutUint32(b[20+8*i:], uint32(v>>32))
	}
	return b
}

// TestFilterDecisions runs the compiled filter in a BPF interpreter for the calls that matter, so a
// change of the profile or the compiler that loosens it fails here before any sandbox starts.
func TestFilterDecisions(t *testing.T) {
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		t.Fatal("this test lays out seccomp_data for a little-endian machine")
	}
	prog, err := filterProgram()
	if err != nil {
		t.Fatal(err)
	}
	vm, err := bpf.NewVM(prog)
	if err != nil {
		t.Fatal(err)
	}
	info, err := arch.GetInfo("")
	if err != nil {
		t.Fatal(err)
	}
	nr := func(name string) int {
		n, ok := info.SyscallNames[name]
		if !ok {
			t.Fatalf("no syscall %s on %s", name, info.Name)
		}
		return n
	}
	const (
		allow = uint32(unix.SECCOMP_RET_ALLOW)
		kill  = uint32(unix.SECCOMP_RET_KILL_PROCESS)
		eperm = uint32(unix.SECCOMP_RET_ERRNO | unix.EPERM)
		enosy = uint32(unix.SECCOMP_RET_ERRNO | unix.ENOSYS)
	)
	native := uint32(info.ID)
	pthread := uint64(unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD |
		unix.CLONE_SYSVSEM | unix.CLONE_SETTLS | unix.CLONE_PARENT_SETTID | unix.CLONE_CHILD_CLEARTID)
	cases := []struct {
		what string
		data []byte
		want uint32
	}{
		{"read", seccompData(nr("read"), native), allow},
		{"execve", seccompData(nr("execve"), native), allow},
		{"ptrace (Docker allows it; the init protects itself)", seccompData(nr("ptrace"), native), allow},
		{"fork", seccompData(nr("clone"), native, uint64(unix.SIGCHLD)), allow},
		{"a thread", seccompData(nr("clone"), native, pthread), allow},
		{"clone into a new user namespace", seccompData(nr("clone"), native, unix.CLONE_NEWUSER|uint64(unix.SIGCHLD)), eperm},
		{"clone into a new net namespace", seccompData(nr("clone"), native, unix.CLONE_NEWNET|pthread), eperm},
		{"clone with the flag in the high half", seccompData(nr("clone"), native, 1<<32|unix.CLONE_NEWUSER), eperm},
		{"clone3", seccompData(nr("clone3"), native), enosy},
		{"unshare(CLONE_NEWUSER)", seccompData(nr("unshare"), native, unix.CLONE_NEWUSER), eperm},
		{"unshare(CLONE_NEWNS)", seccompData(nr("unshare"), native, unix.CLONE_NEWNS), eperm},
		{"socket(AF_INET)", seccompData(nr("socket"), native, unix.AF_INET), allow},
		{"socket(AF_INET6)", seccompData(nr("socket"), native, unix.AF_INET6), allow},
		{"socket(AF_UNIX)", seccompData(nr("socket"), native, unix.AF_UNIX), allow},
		{"socket(AF_NETLINK)", seccompData(nr("socket"), native, unix.AF_NETLINK), allow},
		{"socket(AF_VSOCK)", seccompData(nr("socket"), native, unix.AF_VSOCK), eperm},
		{"socket(AF_VSOCK) with junk in the high half", seccompData(nr("socket"), native, 1<<32|unix.AF_VSOCK), eperm},
		{"socket(AF_INET) with junk in the high half", seccompData(nr("socket"), native, 1<<32|unix.AF_INET), eperm},
		{"personality(PER_LINUX)", seccompData(nr("personality"), native, 0), allow},
		{"personality(query)", seccompData(nr("personality"), native, 0xffffffff), allow},
		{"personality(READ_IMPLIES_EXEC)", seccompData(nr("personality"), native, 0x0400000 /* READ_IMPLIES_EXEC */), eperm},
		{"a number past the table", seccompData(1000, native), enosy},
		{"i386", seccompData(20, uint32(arch.I386.ID)), kill},
		{"arm", seccompData(20, uint32(arch.ARM.ID)), kill},
	}
	if info.ID == arch.X86_64.ID {
		cases = append(cases, struct {
			what string
			data []byte
			want uint32
		}{"x32 getpid", seccompData(0x40000000|39, native), kill})
	}
	// Ours (the list is spelled out, not taken from refusedSyscalls, so that shortening that list
	// fails here), then some of what Docker's profile leaves out.
	for _, name := range []string{"io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl",
		"add_key", "request_key", "userfaultfd", "bpf", "perf_event_open", "kexec_load", "kexec_file_load",
		"init_module", "finit_module", "delete_module", "mount", "umount2", "pivot_root", "chroot", "setns",
		"fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
		"reboot", "acct", "swapon", "syslog", "open_by_handle_at", "quotactl", "settimeofday", "ioperm",
		"iopl", "lookup_dcookie", "vhangup", "nfsservctl"} {
		if n, ok := info.SyscallNames[name]; ok {
			cases = append(cases, struct {
				what string
				data []byte
				want uint32
			}{name, seccompData(n, native), eperm})
		}
	}
	for _, c := range cases {
		got, err := vm.Run(c.data)
		if err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		if uint32(got) != c.want {
			t.Errorf("%s: filter answers %#x, want %#x", c.what, uint32(got), c.want)
		}
	}
}

// TestToolchainsUnderFilter runs what a coding agent runs, inside a sandbox under the syscall
// filter: the interpreters, compilers and package managers of the host's /usr must keep working.
func TestToolchainsUnderFilter(t *testing.T) {
	for _, tool := range []struct{ bin, pkg string }{
		{"python3", "python3 python3-venv"}, {"pip3", "python3-pip"}, {"node", "nodejs"},
		{"npm", "npm"}, {"git", "git"}, {"gcc", "gcc"},
	} {
		if _, err := os.Stat("/usr/bin/" + tool.bin); err != nil {
			t.Fatalf("/usr/bin/%s is missing; sandboxes see the host's /usr, so the test needs it there: apt-get install -y %s (scripts/deps.sh does)", tool.bin, tool.pkg)
		}
	}
	n := newNamespace(t, Config{})
	// venv and npm take seconds, and tens of them on a loaded machine: the exec timeout here is
	// generous because this test is about what the filter refuses, not about speed.
	in, _ := startSandbox(t, n, Template{Limits: Limits{ExecTimeout: Duration(3 * time.Minute), ExecTimeoutMax: Duration(3 * time.Minute)}})
	for _, c := range []struct{ name, cmd, want string }{
		{"python", `python3 -c 'import ssl, sqlite3, hashlib, json, subprocess; print(subprocess.run(["true"]).returncode, hashlib.sha256(b"x").hexdigest()[:8])'`, "0 2d711642\n"},
		{"python threads", `python3 -c 'import concurrent.futures as f; print(sum(f.ThreadPoolExecutor(4).map(abs, range(-5, 0))))'`, "15\n"},
		{"pip", `pip3 --version | cut -d' ' -f1`, "pip\n"},
		{"venv", `python3 -m venv /tmp/venv && /tmp/venv/bin/python -c 'import sys; print(sys.prefix)' && /tmp/venv/bin/pip --version | cut -d' ' -f1`, "/tmp/venv\npip\n"},
		{"node", `node -e 'const fs = require("fs"); fs.writeFileSync("n.txt", "ok"); fs.promises.readFile("n.txt", "utf8").then(s => console.log(s, require("os").cpus().length > 0))'`, "ok true\n"},
		{"node child process and worker", `node -e 'const {execFileSync} = require("child_process"); const {Worker} = require("worker_threads"); process.stdout.write(execFileSync("echo", ["hi"])); new Worker("require(\"worker_threads\").parentPort.postMessage(7)", {eval: true}).on("message", m => console.log(m))'`, "hi\n7\n"},
		{"npm", `npm --version >/dev/null && mkdir -p proj && cd proj && npm init -y >/dev/null && node -p 'require("./package.json").name'`, "proj\n"},
		{"git", `git init -q repo && cd repo && echo a > a && git add a && git -c user.name=u -c user.email=u@x commit -qm m && git log --format=%s`, "m\n"},
		{"gcc", `printf '#include <stdio.h>\n#include <pthread.h>\nstatic void *f(void *a) { return a; }\nint main(void) { pthread_t t; void *r; pthread_create(&t, 0, f, "built"); pthread_join(t, &r); puts(r); return 0; }\n' > hello.c && gcc -O2 -pthread -o hello hello.c && ./hello`, "built\n"},
	} {
		var buf bytes.Buffer
		res, err := in.Exec(context.Background(), ExecRequest{Command: c.cmd + " 2>&1", Stdout: &buf, Timeout: 3 * time.Minute})
		if err != nil {
			t.Fatalf("exec %s: %v", c.name, err)
		}
		if out := buf.String(); res.ExitCode != 0 || out != c.want {
			t.Errorf("%s inside the sandbox: %+v\n%s\nwant %q", c.name, res, out, c.want)
		}
	}
}
