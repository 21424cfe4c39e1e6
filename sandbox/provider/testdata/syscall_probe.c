// syscall_probe tries one kernel interface per argument and prints "NAME ok" or "NAME ERRNO-NAME"
// for each, so a test can tell a seccomp refusal (EPERM) from the kernel's own answer. The
// foreign-ABI probes (i386, x32) make a getpid through the other ABI: a filter that checks the
// architecture kills the process for them, so they print "NAME ok" only when nothing stopped them.
// The provider tests compile it with the host's gcc into a sandbox's workspace.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <linux/perf_event.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

static const char *errname(int e) {
	switch (e) {
	case EPERM: return "EPERM";
	case EACCES: return "EACCES";
	case ENOSYS: return "ENOSYS";
	case EINVAL: return "EINVAL";
	case ENOKEY: return "ENOKEY";
	case EAFNOSUPPORT: return "EAFNOSUPPORT";
	case ENOENT: return "ENOENT";
	case ENOSPC: return "ENOSPC";
	case EFAULT: return "EFAULT";
	case EBADF: return "EBADF";
	default: return strerrorname_np(e) ? strerrorname_np(e) : "E?";
	}
}

static void report(const char *name, long r) {
	if (r < 0)
		printf("%s %s\n", name, errname(errno));
	else
		printf("%s ok\n", name);
	fflush(stdout);
}

// forkexit runs a raw clone with flags and reports whether the child could be created.
static long forkexit(unsigned long flags) {
	long pid = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
	if (pid == 0)
		_exit(0);
	if (pid > 0)
		waitpid(pid, NULL, 0);
	return pid;
}

static long probe(const char *p) {
	if (!strcmp(p, "keyctl"))
		return syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 1);
	if (!strcmp(p, "add_key"))
		return syscall(SYS_add_key, "user", "probe", "x", 1, -2 /* process keyring */);
	if (!strcmp(p, "request_key"))
		return syscall(SYS_request_key, "user", "probe-absent", NULL, 0);
	if (!strcmp(p, "io_uring_setup")) {
		struct io_uring_params params;
		memset(&params, 0, sizeof params);
		return syscall(SYS_io_uring_setup, 1, &params);
	}
	if (!strcmp(p, "io_uring_enter"))
		return syscall(SYS_io_uring_enter, -1, 0, 0, 0, NULL, 0);
	if (!strcmp(p, "io_uring_register"))
		return syscall(SYS_io_uring_register, -1, 0, NULL, 0);
	if (!strcmp(p, "userfaultfd"))
		return syscall(SYS_userfaultfd, O_CLOEXEC | 1 /* UFFD_USER_MODE_ONLY */);
	if (!strcmp(p, "bpf"))
		return syscall(SYS_bpf, 0 /* BPF_MAP_CREATE */, NULL, 0);
	if (!strcmp(p, "perf_event_open")) {
		struct perf_event_attr a;
		memset(&a, 0, sizeof a);
		a.size = sizeof a;
		a.type = PERF_TYPE_SOFTWARE;
		a.config = PERF_COUNT_SW_TASK_CLOCK;
		a.exclude_kernel = 1;
		a.exclude_hv = 1;
		return syscall(SYS_perf_event_open, &a, 0, -1, -1, 0);
	}
	if (!strcmp(p, "vsock"))
		return socket(AF_VSOCK, SOCK_STREAM, 0);
	if (!strcmp(p, "unshare_user"))
		return unshare(CLONE_NEWUSER);
	if (!strcmp(p, "clone_newuser"))
		return forkexit(CLONE_NEWUSER);
	if (!strcmp(p, "clone3"))
		return syscall(SYS_clone3, NULL, 0);
	if (!strcmp(p, "mount"))
		return mount("none", "/tmp", "tmpfs", 0, NULL);
	if (!strcmp(p, "kexec_load"))
		return syscall(SYS_kexec_load, 0, 0, NULL, 0);
	if (!strcmp(p, "fork"))
		return forkexit(0);
	if (!strcmp(p, "inet"))
		return socket(AF_INET, SOCK_STREAM, 0);
	if (!strcmp(p, "unix"))
		return socket(AF_UNIX, SOCK_STREAM, 0);
#if defined(__x86_64__)
	if (!strcmp(p, "i386")) {
		long r;
		__asm__ volatile("int $0x80" : "=a"(r) : "a"(20 /* getpid */) : "memory");
		if (r < 0) {
			errno = -r;
			return -1;
		}
		return r;
	}
	if (!strcmp(p, "x32"))
		return syscall(0x40000000 | 39 /* getpid */);
#endif
	errno = EINVAL;
	return -1;
}

int main(int argc, char **argv) {
	for (int i = 1; i < argc; i++)
		report(argv[i], probe(argv[i]));
	return 0;
}
