package main

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"sync"
	"syscall"
	"time"
)

// undo is what the bench must still undo if it is interrupted: the brokers it started, the builds
// running into their directories and the temporary directories it made. A run that returns undoes
// them with its deferred stops and removals; SIGINT or SIGTERM would end the process without those,
// and the brokers (each in a process group of its own, so that a ^C at the terminal does not reach
// them) would outlive the bench, their data dirs left in /tmp.
//
// The interrupt takes mu and never gives it back: whatever the run does next that needs it (start a
// process, make a directory, forget one undone) waits until the process exits, so nothing starts
// unseen while the bench is being undone.
var undo struct {
	mu   sync.Mutex
	next int
	fns  map[int]func()
}

// guard runs start and, if it succeeds, keeps fn to run should the bench be interrupted; forget
// drops it once the run has undone it itself.
func guard(start func() error, fn func()) (forget func(), err error) {
	undo.mu.Lock()
	defer undo.mu.Unlock()
	if err := start(); err != nil {
		return nil, err
	}
	if undo.fns == nil {
		undo.fns = map[int]func(){}
	}
	id := undo.next
	undo.next++
	undo.fns[id] = fn
	return func() {
		undo.mu.Lock()
		delete(undo.fns, id)
		undo.mu.Unlock()
	}, nil
}

// undoOnInterrupt makes SIGINT and SIGTERM undo everything guarded, newest first (a build before
// the directory it writes into), then exit as the signal would have (128+n). A second signal ends
// the bench at once.
func undoOnInterrupt() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		sig := <-sigs
		signal.Reset(syscall.SIGINT, syscall.SIGTERM)
		undo.mu.Lock() // never unlocked: see undo
		ids := make([]int, 0, len(undo.fns))
		for id := range undo.fns {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		slices.Reverse(ids)
		fmt.Fprintf(os.Stderr, "bench: %v: stopping what it started and removing its temp dirs (again to quit at once)...\n", sig)
		for _, id := range ids {
			undo.fns[id]()
		}
		os.Exit(128 + int(sig.(syscall.Signal)))
	}()
}

// tempDir makes a temporary directory that an interrupt removes too; remove removes it.
func tempDir(pattern string) (dir string, remove func(), err error) {
	forget, err := guard(func() (err error) {
		dir, err = os.MkdirTemp("", pattern)
		return err
	}, func() { os.RemoveAll(dir) })
	if err != nil {
		return "", nil, err
	}
	return dir, func() { forget(); os.RemoveAll(dir) }, nil
}

// runGuarded runs cmd (a build) in a process group of its own that an interrupt ends, compiler and
// linker included, before the directory it writes into goes: the go command makes the output's
// directory, so a build left running would bring it back.
func runGuarded(cmd *exec.Cmd) error {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	done := make(chan struct{})
	forget, err := guard(cmd.Start, func() {
		// SIGINT lets the go command remove its work dir; SIGKILL if it does not end.
		syscall.Kill(-cmd.Process.Pid, syscall.SIGINT)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	})
	if err != nil {
		return err
	}
	err = cmd.Wait()
	close(done)
	forget()
	return err
}
