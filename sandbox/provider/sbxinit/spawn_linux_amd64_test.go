package sbxinit

import (
	"errors"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestSpawn starts commands the way the bridged init does, on the host: the child must come out as
// syscall.ForkExec's would (its own process group, the asked user, cwd and stdio, no signal blocked
// or ignored; exec resets caught ones, and the kernel cleared ours at the clone), and a failure before its exec must come back as the errno, child reaped.
func TestSpawn(t *testing.T) {
	if !spawnSupported() {
		t.Skip("the soft limit of open files is not the hard one: spawn is not used here")
	}
	// The init handles SIGHUP and SIGINT (handleSignals), the two a Go program keeps ignored when
	// its parent ignored them (nohup), so the kernel resets them in each child: the test process
	// does the same, or a test run under nohup would see SIGHUP ignored in the command.
	held := make(chan os.Signal, 1)
	signal.Notify(held, syscall.SIGHUP, syscall.SIGINT)
	defer signal.Stop(held)
	devnull, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(devnull)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	files := [3]uintptr{uintptr(devnull), uintptr(p[1]), uintptr(p[1])}
	if !spawnable(files) {
		t.Fatal("fds above 2 must be spawnable")
	}
	if spawnable([3]uintptr{0, uintptr(p[1]), uintptr(p[1])}) {
		t.Fatal("a stdio fd below 3 must not be spawnable")
	}
	dir := t.TempDir()
	cred := &syscall.Credential{Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid()), Groups: []uint32{}}
	script := `echo $$ $(ps -o pgid= -p $$ 2>/dev/null || cut -d' ' -f5 /proc/$$/stat) $(id -u) $(pwd) "$X" >&2; exec grep -E '^Sig(Blk|Ign)' /proc/self/status`
	pid, err := spawn("/bin/sh", []string{"sh", "-c", script}, []string{"X=y z", "PATH=/usr/bin:/bin"}, dir, files, cred)
	unix.Close(p[1])
	if err != nil {
		t.Fatal(err)
	}
	out, _ := readAll(p[0])
	unix.Close(p[0])
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, 0, nil); err != nil || ws.ExitStatus() != 0 {
		t.Fatalf("wait: %v %v\n%s", err, ws, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	f := strings.Fields(lines[0])
	want := []string{strconv.Itoa(pid), strconv.Itoa(pid), strconv.Itoa(os.Getuid()), dir, "y", "z"}
	if strings.Join(f, " ") != strings.Join(want, " ") {
		t.Errorf("pid, pgid, uid, cwd, env: got %q, want %q", f, want)
	}
	for _, l := range lines[1:] {
		if v := strings.Fields(l); len(v) != 2 || strings.Trim(v[1], "0") != "" {
			t.Errorf("the command must start with no signal blocked or ignored: %s", l)
		}
	}

	for _, tc := range []struct {
		prog, dir string
		want      error
	}{
		{"/nonexistent/prog", "", unix.ENOENT},
		{"/bin/sh", dir + "/missing", unix.ENOENT},
		{dir, "", unix.EACCES},
	} {
		_, err := spawn(tc.prog, []string{"x"}, nil, tc.dir, [3]uintptr{uintptr(devnull), uintptr(devnull), uintptr(devnull)}, cred)
		if !errors.Is(err, tc.want) {
			t.Errorf("spawn %s in %q: %v, want %v", tc.prog, tc.dir, err, tc.want)
		}
	}
	// The failed children were reaped: none is left to wait for.
	if _, err := unix.Wait4(-1, nil, unix.WNOHANG, nil); err != unix.ECHILD {
		t.Errorf("a failed child was left: %v", err)
	}
}

func readAll(fd int) (string, error) {
	var b []byte
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, buf)
		if n > 0 {
			b = append(b, buf[:n]...)
		}
		if n == 0 || err != nil {
			return string(b), err
		}
	}
}
