package sbxinit

import (
	"fmt"
	"strconv"

	"golang.org/x/sys/unix"
)

// openPTY allocates a pseudo-terminal of window rows x cols from the devpts that /dev/ptmx names in
// the init's mount namespace: in a namespace sandbox that is bubblewrap's own devpts instance
// (--dev), so the terminal, its number and its owner belong to the sandbox and never to the host's
// /dev/pts. It answers the master and the slave, both close-on-exec.
func openPTY(rows, cols uint16) (master, slave int, err error) {
	master, err = unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, -1, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	fail := func(what string, err error) (int, int, error) {
		unix.Close(master)
		return -1, -1, fmt.Errorf("%s: %w", what, err)
	}
	if err := unix.IoctlSetPointerInt(master, unix.TIOCSPTLCK, 0); err != nil {
		return fail("unlock the terminal", err)
	}
	if err := unix.IoctlSetWinsize(master, unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols}); err != nil {
		return fail("set the window size", err)
	}
	if slave, err = ptyPeer(master); err != nil {
		return fail("open the terminal", err)
	}
	return master, slave, nil
}

// ptyPeer opens the slave of master. TIOCGPTPEER (Linux 4.13) opens it through the master itself,
// so no path lookup can be raced to another file; kernels (and gVisor) without it get the path of
// the terminal's number in the same devpts.
func ptyPeer(master int) (int, error) {
	fd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(master), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno == 0 {
		return int(fd), nil
	}
	if errno != unix.EINVAL && errno != unix.ENOTTY {
		return -1, errno
	}
	n, err := unix.IoctlGetUint32(master, unix.TIOCGPTN)
	if err != nil {
		return -1, err
	}
	return unix.Open("/dev/pts/"+strconv.FormatUint(uint64(n), 10), unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
}

// OpenPTY is openPTY for the network agent (sandbox/provider/agent): in a pod, /dev/ptmx is the
// container's own devpts, so the terminal belongs to the sandbox as it does here.
func OpenPTY(rows, cols uint16) (master, slave int, err error) { return openPTY(rows, cols) }
