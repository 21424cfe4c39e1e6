#include "textflag.h"

// func rawSpawn(args *cloneArgs, size uintptr, prog *spawnProg) (pid uintptr, errno uintptr)
//
// clone3 with CLONE_VM|CLONE_VFORK|CLONE_CLEAR_SIGHAND: the child shares our memory and stack
// until it execs, so it never returns into Go and never writes to the stack. It runs prog's
// syscalls in order with registers only; at the first that fails it stores the errno in prog and
// exits 127. The last call is execve, which does not return on success. The parent is suspended
// by the kernel until the child has exec'd or exited, so prog.errno is final when clone3 returns.
TEXT ·rawSpawn(SB),NOSPLIT|NOFRAME,$0-40
	MOVQ	args+0(FP), DI
	MOVQ	size+8(FP), SI
	MOVQ	prog+16(FP), R12
	MOVQ	$435, AX // SYS_clone3
	SYSCALL
	CMPQ	AX, $0
	JEQ	child
	CMPQ	AX, $0xfffffffffffff001
	JLS	parentok
	NEGQ	AX
	MOVQ	$0, pid+24(FP)
	MOVQ	AX, errno+32(FP)
	RET
parentok:
	MOVQ	AX, pid+24(FP)
	MOVQ	$0, errno+32(FP)
	RET

child:
	// R12: prog; R13: calls left; BX: the current call (nr, a1..a6: 7 words).
	MOVQ	0(R12), R13
	LEAQ	16(R12), BX
next:
	CMPQ	R13, $0
	JEQ	fell
	MOVQ	0(BX), AX
	MOVQ	8(BX), DI
	MOVQ	16(BX), SI
	MOVQ	24(BX), DX
	MOVQ	32(BX), R10
	MOVQ	40(BX), R8
	MOVQ	48(BX), R9
	SYSCALL
	CMPQ	AX, $0xfffffffffffff001
	JHI	failed
	ADDQ	$56, BX
	DECQ	R13
	JMP	next
fell:
	// execve returned success: impossible; report ENOEXEC rather than run on.
	MOVQ	$-8, AX
failed:
	NEGQ	AX
	MOVQ	AX, 8(R12)
	MOVQ	$127, DI
	MOVQ	$231, AX // SYS_exit_group
	SYSCALL
	JMP	failed // not reached
