package provider

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// hideArgs moves a bwrap command's arguments into a memfd that bwrap reads with --args, appended to
// cmd.ExtraFiles (launch closes it once bwrap has it). Every local user can read any process's
// command line (ps, /proc/<pid>/cmdline), and bwrap's names the data dir, the sandbox's id and its
// bind mounts; now it is "bwrap --args N -- COMMAND..." (bwrap takes the command only from its own
// command line, and the init's names nothing: /proc/self/fd/4 sandbox-init).
func hideArgs(cmd *exec.Cmd) error {
	opts, command := cmd.Args[1:], []string(nil)
	for i, a := range opts {
		if a == "--" {
			opts, command = opts[:i], opts[i:]
			break
		}
	}
	var b bytes.Buffer
	for _, a := range opts {
		if strings.IndexByte(a, 0) >= 0 {
			return fmt.Errorf("bwrap argument %q holds a NUL byte", a)
		}
		b.WriteString(a)
		b.WriteByte(0)
	}
	fd, err := unix.MemfdCreate("bwrap-args", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("bwrap arguments: %w", err)
	}
	f := os.NewFile(uintptr(fd), "bwrap-args")
	if _, err := f.Write(b.Bytes()); err != nil {
		f.Close()
		return fmt.Errorf("bwrap arguments: %w", err)
	}
	if _, err := f.Seek(0, 0); err != nil {
		f.Close()
		return fmt.Errorf("bwrap arguments: %w", err)
	}
	cmd.ExtraFiles = append(cmd.ExtraFiles, f)
	// ExtraFiles[i] is fd 4+i in bwrap: launch puts the control socket at 3 before them.
	cmd.Args = append([]string{cmd.Args[0], "--args", strconv.Itoa(3 + len(cmd.ExtraFiles))}, command...)
	return nil
}
