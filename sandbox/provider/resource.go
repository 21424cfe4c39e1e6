package provider

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

var (
	// ErrNoNamespaces means this host cannot run namespace sandboxes at all: bwrap is not installed,
	// or unprivileged user namespaces are disabled or blocked. It is the one error on which
	// Preflight's "auto" falls back to the dir provider.
	ErrNoNamespaces = errors.New("this host cannot run namespace sandboxes")
	// ErrResource is what every *ResourceError is (errors.Is): the host ran out of something the
	// operator can free. It never makes Preflight fall back to a weaker provider.
	ErrResource = errors.New("host resource exhausted")
)

// ResourceError is a failure because the host, or the broker's user, ran out of a resource: disk
// space or inodes, open files, processes, memory or user namespaces. Fix says how to free it.
type ResourceError struct {
	// Errno is the error the kernel gave: ENOSPC, EDQUOT, EMFILE, ENFILE, EAGAIN or ENOMEM.
	Errno syscall.Errno
	// Resource names what ran out, e.g. "disk space or inodes in the data dir".
	Resource string
	// Fix says how to free it.
	Fix string
	// Err is the failure as it happened.
	Err error
}

func (e *ResourceError) Error() string {
	return fmt.Sprintf("out of %s: %s: %s", e.Resource, e.Err, e.Fix)
}

// Unwrap returns the failure as it happened.
func (e *ResourceError) Unwrap() error { return e.Err }

// Is makes every ResourceError match ErrResource.
func (e *ResourceError) Is(target error) bool { return target == ErrResource }

// resourceErrnos are the errors that mean "out of something", most specific first: ENFILE's text
// contains EMFILE's.
var resourceErrnos = []syscall.Errno{unix.ENFILE, unix.EMFILE, unix.ENOSPC, unix.EDQUOT, unix.EAGAIN, unix.ENOMEM}

// classify sorts a failure of the namespace provider's preflight into: ErrNoNamespaces (the host
// cannot do namespaces at all), a *ResourceError, or err itself (anything else, which the operator
// must look at). It errs on the side of not ErrNoNamespaces: only that one leads to the dir provider.
func classify(err error, cfg Config) error {
	if errors.Is(err, ErrNoNamespaces) {
		return err
	}
	msg := strings.TrimPrefix(err.Error(), ErrUnavailable.Error()+": ")
	// max_user_namespaces=0 makes namespace creation fail with ENOSPC, like a used-up quota; a zero
	// sysctl is the host saying "never", not a quota.
	if hint := usernsDisabled(); hint != "" {
		return fmt.Errorf("%w: %s; %s", ErrNoNamespaces, msg, hint)
	}
	if re := resourceError(err, cfg); re != nil {
		return re
	}
	if _, serr := os.Stat("/proc/self/ns/user"); serr != nil {
		return fmt.Errorf("%w: %s; this kernel has no user namespaces (CONFIG_USER_NS)", ErrNoNamespaces, msg)
	}
	if namespaceDenied(msg) {
		hint := "unprivileged user namespaces are blocked here (a container's seccomp or AppArmor profile?): allow them for bwrap"
		if readSysctl("kernel/apparmor_restrict_unprivileged_userns") == "1" {
			hint = "AppArmor restricts unprivileged user namespaces: give bwrap an AppArmor profile that allows userns, or sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
		}
		return fmt.Errorf("%w: %s; %s", ErrNoNamespaces, msg, hint)
	}
	return err
}

// namespaceDenied reports whether bwrap's message says it was not allowed to set up the user
// namespace ("Creating new namespace failed: Operation not permitted", "setting up uid map:
// Permission denied", "No permissions to creating new namespace"). bwrap is another program: its
// stderr text is all we have.
func namespaceDenied(msg string) bool {
	low := strings.ToLower(msg)
	aboutUserns := false
	for _, s := range []string{"new namespace", "uid map", "uid_map", "gid map", "gid_map", "setgroups"} {
		aboutUserns = aboutUserns || strings.Contains(low, s)
	}
	return aboutUserns && (strings.Contains(low, unix.EPERM.Error()) || strings.Contains(low, unix.EACCES.Error()) ||
		strings.Contains(low, "no permissions"))
}

// resourceError returns a *ResourceError if err is one of resourceErrnos, as a Go error or in the
// text bwrap or the init wrote (strerror's words are Go's Errno.Error() words, in another case).
func resourceError(err error, cfg Config) *ResourceError {
	var errno syscall.Errno
	found := false
	var e syscall.Errno
	if errors.As(err, &e) {
		for _, r := range resourceErrnos {
			if e == r {
				errno, found = e, true
			}
		}
	}
	low := strings.ToLower(err.Error())
	for _, r := range resourceErrnos {
		if !found && strings.Contains(low, r.Error()) {
			errno, found = r, true
		}
	}
	if !found {
		return nil
	}
	uid := os.Geteuid()
	if uid == 0 {
		uid = cfg.UID
		if uid == 0 {
			uid = DefaultUID
		}
	}
	re := &ResourceError{Errno: errno, Err: err}
	switch {
	case errno == unix.ENOSPC && (strings.Contains(low, "new namespace") || strings.Contains(low, "user namespace") || strings.Contains(low, "unshare")):
		re.Resource = "user namespaces"
		re.Fix = fmt.Sprintf("uid %d holds as many user namespaces as user.max_user_namespaces (%s) allows: end the processes that hold them (lsns -t user lists them; a sandbox that nests namespaces is the usual cause) or raise the limit (sysctl -w user.max_user_namespaces=N), then start again",
			uid, readSysctl("user/max_user_namespaces"))
	case errno == unix.ENOSPC || errno == unix.EDQUOT:
		re.Resource = "disk space or inodes"
		re.Fix = fmt.Sprintf("the filesystem of the data dir %s is full%s: free space and inodes there (delete sandboxes you no longer need, check with df -h -i %s), then start again",
			cfg.DataDir, freeSpace(cfg.DataDir), cfg.DataDir)
	case errno == unix.EMFILE:
		var lim unix.Rlimit
		unix.Getrlimit(unix.RLIMIT_NOFILE, &lim)
		re.Resource = "open files"
		re.Fix = fmt.Sprintf("the broker has as many files open as its limit allows (ulimit -n: %d): raise it (ulimit -n N, or LimitNOFILE= in its systemd unit), then start again", lim.Cur)
	case errno == unix.ENFILE:
		re.Resource = "open files on this host"
		re.Fix = fmt.Sprintf("the host has as many files open as fs.file-max (%s) allows: close files or raise it (sysctl -w fs.file-max=N), then start again", readSysctl("fs/file-max"))
	case errno == unix.EAGAIN:
		re.Resource = "processes or threads"
		re.Fix = fmt.Sprintf("a process limit is reached (ulimit -u of uid %d or of the broker's user, kernel.threads-max, kernel.pid_max, or a pids cgroup): end stray processes or raise the limit, then start again", uid)
	default: // ENOMEM
		re.Resource = "memory"
		re.Fix = "the host (or the broker's memory cgroup) is out of memory: free memory, then start again"
	}
	return re
}

// freeSpace is " (N MiB and M inodes free)" for the filesystem holding dir, or "" if unknown.
func freeSpace(dir string) string {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return ""
	}
	return fmt.Sprintf(" (%d MiB and %d inodes free)", st.Bavail*uint64(st.Bsize)>>20, st.Ffree)
}

// usernsDisabled names the sysctl that turns unprivileged user namespaces off on this host, if any.
func usernsDisabled() string {
	switch {
	case readSysctl("kernel/unprivileged_userns_clone") == "0":
		return "user namespaces are disabled: sysctl -w kernel.unprivileged_userns_clone=1"
	case readSysctl("user/max_user_namespaces") == "0":
		return "user namespaces are disabled: sysctl -w user.max_user_namespaces=15000"
	}
	return ""
}

func readSysctl(name string) string {
	b, err := os.ReadFile("/proc/sys/" + name)
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}
