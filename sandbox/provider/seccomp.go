package provider

import (
	"encoding/binary"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	dockerprofile "github.com/moby/profiles/seccomp"
	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// The syscall filter every namespace sandbox runs under (bwrap --seccomp). It is an allow-list:
// Docker's default profile, resolved the way Docker resolves it for a container with no
// capabilities on this architecture and kernel (github.com/moby/profiles/seccomp), compiled by
// github.com/elastic/go-seccomp-bpf, with these changes:
//
//   - the architecture is checked first and any other ABI of this CPU (i386 through int 0x80, x32
//     syscall numbers) kills the process: their syscall numbers mean other calls, and nothing in a
//     sandbox has a reason to use them;
//   - a syscall number above the newest this table knows answers ENOSYS, so a libc newer than the
//     table falls back as it does on an older kernel (runc does the same);
//   - refusedSyscalls and refusedArgs below are refused before the profile is consulted, so they stay
//     refused whatever a later profile allows;
//   - everything else not on the list answers EPERM, as under Docker.
//
// No-new-privileges is set by bwrap before it loads the filter.

// refusedSyscalls are refused with EPERM even where Docker's profile allows them: kernel surfaces
// with a history of privilege escalations that code in a sandbox does not need (io_uring, keyrings,
// which are keyed by uid and so shared with other sandboxes, userfaultfd, which makes kernel races
// easy to win, bpf and perf events), and the calls that change the mount table, load a kernel or
// join other namespaces. Nested user namespaces are refused through the flags of unshare and clone
// (refusedArgs) and clone3, whose flags a filter cannot read, answers ENOSYS as under Docker.
var refusedSyscalls = []string{
	"io_uring_setup", "io_uring_enter", "io_uring_register",
	"keyctl", "add_key", "request_key",
	"userfaultfd", "bpf", "perf_event_open",
	"kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
	"mount", "umount2", "pivot_root", "chroot", "setns",
	"fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
}

// nsFlags are the clone/unshare flags that create namespaces.
const nsFlags = unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWUSER |
	unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWCGROUP | unix.CLONE_NEWTIME

// rule is one line of the policy: when every condition holds (always, with none), action.
type rule struct {
	conds  []specs.LinuxSeccompArg
	action seccomp.Action
}

// refusedArgs are calls refused with EPERM for some arguments, whatever a later rule says: AF_VSOCK
// sockets (the way to the hypervisor and other VMs of this host) and new namespaces of any kind.
// Clone's flags are its first argument on every architecture the compiler has tables for.
var refusedArgs = map[string][]specs.LinuxSeccompArg{
	"socket":  {{Index: 0, Op: specs.OpEqualTo, Value: unix.AF_VSOCK}},
	"unshare": {{Index: 0, Op: opBitsSet, Value: nsFlags}},
	"clone":   {{Index: 0, Op: opBitsSet, Value: nsFlags}},
}

// opBitsSet (arg & value != 0) is ours: OCI profiles have only its negation, SCMP_CMP_MASKED_EQ
// with 0.
const opBitsSet specs.LinuxSeccompOperator = "bits_set"

// errnoAction is the filter's answer for a refused call: the call fails with errno and does nothing.
func errnoAction(errno unix.Errno) seccomp.Action {
	return seccomp.ActionErrno | seccomp.Action(errno&unix.SECCOMP_RET_DATA)
}

// sandboxFilter is the compiled filter as bwrap reads it (an array of struct sock_filter), built once.
var sandboxFilter = sync.OnceValues(func() ([]byte, error) {
	prog, err := filterProgram()
	if err != nil {
		return nil, err
	}
	return encodeFilter(prog)
})

// filterProgram is the whole filter. It has three parts, each leaving the syscall number in the
// accumulator for the next:
//
//  1. the ABI checks: another architecture or x32 kills the process; a number past the table's
//     newest answers ENOSYS;
//  2. the calls decided by their arguments (socket, clone, unshare, personality): one block each,
//     which returns on every path, so what it loads into the accumulator does not matter after it;
//  3. every other call by number alone, assembled by go-seccomp-bpf, then EPERM. Its own argument
//     support is not used: it compares the next syscall number against the argument it loaded.
//
// Part 3 only ever looks at the syscall number, so the kernel can prove its answer for a given
// number constant and skip the filter for those calls altogether (the seccomp action cache).
func filterProgram() ([]bpf.Instruction, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("%w: no syscall filter for this architecture (%v): the namespace provider needs one to hold its isolation", ErrUnavailable, err)
	}
	byArgs, policy, err := filterPolicy(info)
	if err != nil {
		return nil, err
	}
	newest := slices.Max(slices.Collect(maps.Keys(info.SyscallNumbers)))
	// seccomp_data: nr at offset 0, arch at 4, args from 16.
	a := &bpfAsm{}
	a.load(4)
	native := a.newLabel()
	a.jump(bpf.JumpEqual, uint32(info.ID), native, next)
	a.ret(uint32(seccomp.ActionKillProcess))
	a.set(native)
	a.load(0)
	if info.ID == arch.X86_64.ID {
		// x32 shares x86_64's audit arch and sets bit 30 of the number instead.
		native64 := a.newLabel()
		a.jump(bpf.JumpBitsSet, uint32(arch.X32.SeccompMask), next, native64)
		a.ret(uint32(seccomp.ActionKillProcess))
		a.set(native64)
	}
	known := a.newLabel()
	a.jump(bpf.JumpGreaterThan, uint32(newest), next, known)
	a.ret(uint32(errnoAction(unix.ENOSYS)))
	a.set(known)
	for _, name := range slices.Sorted(maps.Keys(byArgs)) {
		skip := a.newLabel()
		a.jump(bpf.JumpEqual, uint32(info.SyscallNames[name]), next, skip)
		for _, r := range byArgs[name] {
			nextRule := a.newLabel()
			for _, c := range r.conds {
				if err := a.cond(c, nextRule); err != nil {
					return nil, fmt.Errorf("%w: syscall filter: %s: %v", ErrUnavailable, name, err)
				}
			}
			a.ret(uint32(r.action))
			a.set(nextRule)
		}
		a.ret(uint32(errnoAction(unix.EPERM)))
		a.set(skip) // reached only by the jump above: the accumulator still holds the number
	}
	head, err := a.assemble()
	if err != nil {
		return nil, fmt.Errorf("%w: syscall filter: %v", ErrUnavailable, err)
	}
	body, err := policy.Assemble()
	if err != nil {
		return nil, fmt.Errorf("%w: syscall filter: %v", ErrUnavailable, err)
	}
	prog := append(head, body...)
	if len(prog) > unix.BPF_MAXINSNS {
		return nil, fmt.Errorf("%w: syscall filter has %d instructions, over the kernel's %d", ErrUnavailable, len(prog), unix.BPF_MAXINSNS)
	}
	return prog, nil
}

// filterPolicy splits the allow-list into the calls decided by their arguments (our refusals first,
// then Docker's rules in its order) and a policy for the rest: our refusals, then Docker's default
// profile for a process without capabilities on this architecture and kernel, then EPERM.
func filterPolicy(info *arch.Info) (map[string][]rule, *seccomp.Policy, error) {
	noCaps := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{}}}
	profile, err := dockerprofile.GetDefaultProfile(noCaps)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: syscall filter: Docker's default profile: %v", ErrUnavailable, err)
	}
	byArgs := map[string][]rule{}
	for name, conds := range refusedArgs {
		byArgs[name] = []rule{{conds: conds, action: errnoAction(unix.EPERM)}}
	}
	for _, r := range profile.Syscalls {
		if len(r.Args) == 0 {
			continue
		}
		action, err := ruleAction(r)
		if err != nil {
			return nil, nil, err
		}
		for _, name := range r.Names {
			if _, ok := info.SyscallNames[name]; ok && !slices.Contains(refusedSyscalls, name) {
				byArgs[name] = append(byArgs[name], rule{conds: r.Args, action: action})
			}
		}
	}
	p := &seccomp.Policy{DefaultAction: seccomp.ActionErrno} // EPERM
	refused := seccomp.SyscallGroup{Action: errnoAction(unix.EPERM)}
	for _, name := range refusedSyscalls {
		if _, ok := info.SyscallNames[name]; ok {
			refused.Names = append(refused.Names, name)
		}
	}
	p.Syscalls = append(p.Syscalls, refused)
	for _, r := range profile.Syscalls {
		action, err := ruleAction(r)
		if err != nil {
			return nil, nil, err
		}
		g := seccomp.SyscallGroup{Action: action}
		for _, name := range r.Names {
			// The profile lists the names of every architecture (chown32, socketcall, ...); a
			// name this one does not have is not a call anyone here can make.
			if _, ok := info.SyscallNames[name]; !ok || slices.Contains(refusedSyscalls, name) {
				continue
			}
			if _, ok := byArgs[name]; ok {
				// Decided in its own block; a rule without conditions ends it.
				if len(r.Args) == 0 {
					byArgs[name] = append(byArgs[name], rule{action: action})
				}
				continue
			}
			g.Names = append(g.Names, name)
		}
		if len(g.Names) > 0 {
			p.Syscalls = append(p.Syscalls, g)
		}
	}
	return byArgs, p, nil
}

func ruleAction(r specs.LinuxSyscall) (seccomp.Action, error) {
	switch {
	case r.Action == specs.ActAllow:
		return seccomp.ActionAllow, nil
	case r.Action == specs.ActErrno && r.ErrnoRet != nil:
		return errnoAction(unix.Errno(*r.ErrnoRet)), nil
	}
	return 0, fmt.Errorf("%w: syscall filter: Docker's profile has a rule (%s for %v) this broker cannot compile", ErrUnavailable, r.Action, r.Names)
}

// bpfAsm assembles a forward-jumping classic BPF program with labels.
type bpfAsm struct {
	ins    []bpf.Instruction
	jumps  map[int][2]label // instruction index → true and false targets
	labels []int            // label → instruction index, -1 until set
}

type label int

// next is the label of the instruction after a jump.
const next label = -1

func (a *bpfAsm) newLabel() label {
	a.labels = append(a.labels, -1)
	return label(len(a.labels) - 1)
}

func (a *bpfAsm) set(l label) { a.labels[l] = len(a.ins) }

func (a *bpfAsm) load(off uint32) { a.ins = append(a.ins, bpf.LoadAbsolute{Off: off, Size: 4}) }

func (a *bpfAsm) ret(v uint32) { a.ins = append(a.ins, bpf.RetConstant{Val: v}) }

func (a *bpfAsm) jump(cond bpf.JumpTest, val uint32, t, f label) {
	if a.jumps == nil {
		a.jumps = map[int][2]label{}
	}
	a.jumps[len(a.ins)] = [2]label{t, f}
	a.ins = append(a.ins, bpf.JumpIf{Cond: cond, Val: val})
}

// cond emits a test of one 64-bit argument, in two 32-bit halves (little-endian: the low half
// first), that falls through when it holds and jumps to fail when it does not.
func (a *bpfAsm) cond(c specs.LinuxSeccompArg, fail label) error {
	if c.Index > 5 {
		return fmt.Errorf("argument %d", c.Index)
	}
	lo, hi := 16+8*uint32(c.Index), 16+8*uint32(c.Index)+4
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		lo, hi = hi, lo
	}
	vlo, vhi := uint32(c.Value), uint32(c.Value>>32)
	pass := a.newLabel()
	switch c.Op {
	case specs.OpEqualTo:
		a.load(hi)
		a.jump(bpf.JumpEqual, vhi, next, fail)
		a.load(lo)
		a.jump(bpf.JumpEqual, vlo, pass, fail)
	case specs.OpLessThan:
		a.load(hi)
		a.jump(bpf.JumpGreaterOrEqual, vhi, next, pass) // hi < vhi
		a.jump(bpf.JumpGreaterThan, vhi, fail, next)    // hi > vhi
		a.load(lo)
		a.jump(bpf.JumpGreaterOrEqual, vlo, fail, pass)
	case specs.OpMaskedEqual, opBitsSet:
		// MASKED_EQ with 0 is arg & mask == 0, the only masked test the profile uses.
		if c.Op == specs.OpMaskedEqual && c.ValueTwo != 0 {
			return fmt.Errorf("masked comparison with %#x", c.ValueTwo)
		}
		whenSet, whenClear := fail, pass
		if c.Op == opBitsSet {
			whenSet, whenClear = pass, fail
		}
		a.load(hi)
		a.jump(bpf.JumpBitsSet, vhi, whenSet, next)
		a.load(lo)
		a.jump(bpf.JumpBitsSet, vlo, whenSet, whenClear)
	default:
		return fmt.Errorf("comparison %q", c.Op)
	}
	a.set(pass)
	return nil
}

// assemble resolves every jump; a jump too far for classic BPF's 8-bit offsets is an error.
func (a *bpfAsm) assemble() ([]bpf.Instruction, error) {
	out := slices.Clone(a.ins)
	for at, t := range a.jumps {
		var skip [2]int
		for i, l := range t {
			target := at + 1
			if l != next {
				target = a.labels[l]
			}
			if target < 0 {
				return nil, fmt.Errorf("unset label at instruction %d", at)
			}
			skip[i] = target - at - 1
			if skip[i] < 0 || skip[i] > 255 {
				return nil, fmt.Errorf("jump of %d at instruction %d", skip[i], at)
			}
		}
		j := out[at].(bpf.JumpIf)
		j.SkipTrue, j.SkipFalse = uint8(skip[0]), uint8(skip[1])
		out[at] = j
	}
	return out, nil
}

// encodeFilter turns a program into the struct sock_filter array the kernel takes, in this
// machine's byte order.
func encodeFilter(prog []bpf.Instruction) ([]byte, error) {
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil, fmt.Errorf("%w: syscall filter: %v", ErrUnavailable, err)
	}
	out := make([]byte, 0, 8*len(raw))
	for _, ins := range raw {
		out = binary.NativeEndian.AppendUint16(out, ins.Op)
		out = append(out, ins.Jt, ins.Jf)
		out = binary.NativeEndian.AppendUint32(out, ins.K)
	}
	return out, nil
}

// filterFile is a new memfd holding the filter, for bwrap's --seccomp, which reads it to the end. A
// memfd rather than a pipe: a pipe's buffer can be a single page for a user over its pipe quota,
// and the write would then wait for a reader that only exists once the write is done.
func filterFile() (*os.File, error) {
	prog, err := sandboxFilter()
	if err != nil {
		return nil, err
	}
	fd, err := unix.MemfdCreate("sbx-seccomp", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("syscall filter: %w", err)
	}
	f := os.NewFile(uintptr(fd), "sbx-seccomp")
	if _, err := f.Write(prog); err != nil {
		f.Close()
		return nil, fmt.Errorf("syscall filter: %w", err)
	}
	if _, err := f.Seek(0, 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("syscall filter: %w", err)
	}
	return f, nil
}
