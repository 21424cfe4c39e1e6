package tests

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// openPTY opens a pseudo-terminal pair that nothing answers on: what a terminal that ignores
// queries (script, expect, an editor's shell buffer, a CI runner's pty) looks like to sbctl.
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); s.Close() })
	return m, s
}

// sbctl on a terminal sends it nothing it did not ask to print. The TUI library's package init
// asked every terminal for its background colour (OSC 11, then a cursor report) before any
// command ran, and waited 5 s for an answer reading the terminal's input: every command on a
// terminal that does not answer took 5 s and swallowed what was typed meanwhile (sbctl shell lost
// its first line), and one that answers got replies a script did not expect.
func TestSbctlDoesNotQueryTheTerminal(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"list", "--broker", "http://127.0.0.1:1"}} {
		master, slave := openPTY(t)
		cmd := exec.Command(filepath.Join(bin, "sbctl"), args...)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
		cmd.Env = append(os.Environ(), "TERM=xterm-256color", "CI=", "HOME="+t.TempDir())
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		slave.Close()
		var out bytes.Buffer
		io.Copy(&out, master) // until the terminal's last user, sbctl, has exited (EIO)
		cmd.Wait()
		if bytes.Contains(out.Bytes(), []byte("\x1b]11;?")) || bytes.Contains(out.Bytes(), []byte("\x1b[6n")) {
			t.Fatalf("sbctl %s queried the terminal: %q", strings.Join(args, " "), out.String())
		}
	}
}
