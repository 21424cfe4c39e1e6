//go:build unix

package backend

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/workspace"
)

// exitGrace is how long output is still read after the command exits: a background child
// (`server &`) keeps the pipe open and must not hold the answer.
const exitGrace = 20 * time.Millisecond

// local runs tools on the host, in root, which it presents as /workspace. There is no isolation:
// it is the agent's CLI mode, on the person's own machine.
type local struct {
	root  string
	files *workspace.Workspace
	mu    sync.Mutex
	bg    map[int]*exec.Cmd // background processes, killed on Close
}

// Local returns a Backend on the host directory root (shown to tools as /workspace).
func Local(root string) (Backend, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	files, err := workspace.Open(abs, workspace.Options{UID: -1, GID: -1})
	if err != nil {
		return nil, err
	}
	return &local{root: abs, files: files, bg: map[int]*exec.Cmd{}}, nil
}

func (l *local) ID() string { return "local:" + l.root }

func (l *local) Stat(_ context.Context, p string) (protocol.FileInfo, error) { return l.files.Stat(p) }

func (l *local) Ls(ctx context.Context, p string) ([]protocol.FileInfo, error) {
	res, err := l.files.ListContext(ctx, p)
	entries := res.Entries
	if err == nil && entries == nil {
		entries = []protocol.FileInfo{}
	}
	return entries, err
}

func (l *local) Read(ctx context.Context, a protocol.ReadArgs) (protocol.ReadResult, error) {
	return l.files.ReadContext(ctx, a)
}

func (l *local) Write(_ context.Context, a protocol.WriteArgs) (protocol.WriteResult, error) {
	return l.files.Write(a)
}

func (l *local) Edit(_ context.Context, a protocol.EditArgs) (protocol.EditResult, error) {
	return l.files.Edit(a)
}

func (l *local) Delete(_ context.Context, a protocol.DeleteArgs) error { return l.files.Delete(a) }
func (l *local) Mkdir(_ context.Context, a protocol.MkdirArgs) error   { return l.files.Mkdir(a) }
func (l *local) Move(_ context.Context, a protocol.MoveArgs) error     { return l.files.Move(a) }

func (l *local) Glob(ctx context.Context, a protocol.GlobArgs) (protocol.GlobResult, error) {
	return l.files.GlobContext(ctx, a)
}

func (l *local) Grep(ctx context.Context, a protocol.GrepArgs) (protocol.GrepResult, error) {
	return l.files.Grep(ctx, a)
}

func (l *local) Upload(_ context.Context, p string, r io.Reader) (protocol.WriteResult, error) {
	up, err := l.files.Create(p, protocol.WriteOverwrite)
	if err != nil {
		return protocol.WriteResult{}, err
	}
	if _, err := io.Copy(up, r); err != nil {
		up.Abort()
		return protocol.WriteResult{}, err
	}
	return up.Commit()
}

func (l *local) Download(_ context.Context, p string, w io.Writer) (int64, error) {
	f, _, err := l.files.OpenRead(p)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return io.Copy(w, f)
}

func (l *local) Env(context.Context) (map[string]string, error) {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	return env, nil
}

func (l *local) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for pid := range l.bg {
		syscall.Kill(-pid, syscall.SIGKILL)
	}
	return l.files.Close()
}

// Exec runs the command on the host with the same semantics as in a sandbox: its own process group
// (a timeout or cancel kills the whole group), cwd under root, output capped.
func (l *local) Exec(ctx context.Context, r ExecRequest) (protocol.ExecResult, error) {
	a := r.ExecArgs
	// Writers stream, as Remote's do: the limits are those of a streamed request.
	a.Stream = a.Stream || r.Stdout != nil
	if err := protocol.ValidateExec(a); err != nil {
		return protocol.ExecResult{}, err
	}
	rel, err := protocol.ResolvePath(a.Cwd)
	if a.Cwd == "" {
		rel, err = ".", nil
	}
	if err != nil {
		return protocol.ExecResult{}, err
	}
	argv := a.Argv
	if a.Command != "" {
		argv = []string{"/bin/sh", "-c", a.Command}
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = filepath.Join(l.root, rel)
	if fi, err := os.Stat(cmd.Dir); err != nil || !fi.IsDir() {
		return protocol.ExecResult{}, protocol.Errorf(protocol.CodeInvalidArgument, "cwd %s is not a directory", a.Cwd)
	}
	cmd.Env = os.Environ()
	for k, v := range a.Env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if a.Stdin != "" {
		cmd.Stdin = strings.NewReader(a.Stdin)
	}
	if a.Background {
		if err := cmd.Start(); err != nil {
			return protocol.ExecResult{}, startError(argv[0], err)
		}
		l.mu.Lock()
		l.bg[cmd.Process.Pid] = cmd
		l.mu.Unlock()
		go func() {
			cmd.Wait()
			l.mu.Lock()
			delete(l.bg, cmd.Process.Pid)
			l.mu.Unlock()
		}()
		return protocol.ExecResult{Pid: cmd.Process.Pid}, nil
	}

	timeout := a.Timeout(protocol.ExecDefaultTimeout, protocol.ExecMaxTimeout)
	var stdout, stderr bytes.Buffer
	outW, errW := r.Stdout, r.Stderr
	if outW == nil {
		outW = &stdout
		if !a.Combined {
			errW = &stderr
		}
	} else if a.Combined {
		errW = nil
	}
	capped := protocol.NewExecOutputLimit(a.OutputCap())
	outR, outPW, err := os.Pipe()
	if err != nil {
		return protocol.ExecResult{}, err
	}
	cmd.Stdout, cmd.Stderr = outPW, outPW
	var errR *os.File
	if errW != nil {
		var errPW *os.File
		if errR, errPW, err = os.Pipe(); err != nil {
			outR.Close()
			outPW.Close()
			return protocol.ExecResult{}, err
		}
		cmd.Stderr = errPW
		defer errPW.Close()
	}
	start := time.Now()
	err = cmd.Start()
	outPW.Close()
	if errR != nil {
		cmd.Stderr.(*os.File).Close()
	}
	if err != nil {
		outR.Close()
		if errR != nil {
			errR.Close()
		}
		return protocol.ExecResult{}, startError(argv[0], err)
	}
	pgid := cmd.Process.Pid
	var reason string
	var reasonMu sync.Mutex
	kill := func(why string) {
		reasonMu.Lock()
		if reason == "" {
			reason = why
		}
		reasonMu.Unlock()
		syscall.Kill(-pgid, syscall.SIGKILL)
	}
	timer := time.AfterFunc(timeout, func() { kill(protocol.ExecReasonTimeout) })
	stop := context.AfterFunc(ctx, func() { kill(protocol.ExecReasonCancelled) })

	exited := make(chan struct{})
	var wg sync.WaitGroup
	drain := func(f *os.File, w io.Writer) {
		defer wg.Done()
		defer f.Close()
		buf := make([]byte, 32<<10)
		for {
			n, err := f.Read(buf)
			if n > 0 {
				capped.Deliver(w, buf[:n])
			}
			if err != nil {
				return
			}
			select {
			case <-exited:
				f.SetReadDeadline(time.Now().Add(exitGrace))
			default:
			}
		}
	}
	wg.Add(1)
	go drain(outR, outW)
	if errR != nil {
		wg.Add(1)
		go drain(errR, errW)
	}
	waitErr := cmd.Wait()
	close(exited)
	outR.SetReadDeadline(time.Now().Add(exitGrace))
	if errR != nil {
		errR.SetReadDeadline(time.Now().Add(exitGrace))
	}
	wg.Wait()
	timer.Stop()
	stop()

	res := protocol.ExecResult{DurationMS: time.Since(start).Milliseconds(), Truncated: capped.Truncated()}
	var ee *exec.ExitError
	if errors.As(waitErr, &ee) {
		ws := ee.Sys().(syscall.WaitStatus)
		if ws.Signaled() {
			res.Signal = strings.TrimPrefix(signalName(ws.Signal()), "SIG")
			res.ExitCode = 128 + int(ws.Signal())
		} else {
			res.ExitCode = ws.ExitStatus()
		}
	}
	reasonMu.Lock()
	res.Reason = reason
	reasonMu.Unlock()
	if res.Cancelled() {
		return protocol.ExecResult{}, protocol.Errorf(protocol.CodeCancelled, "the command was cancelled")
	}
	if r.Stdout == nil {
		res.SetOutput(a, stdout.Bytes(), stderr.Bytes())
	}
	return res, nil
}

func startError(prog string, err error) error {
	if errors.Is(err, exec.ErrNotFound) || errors.Is(err, os.ErrNotExist) {
		return protocol.Errorf(protocol.CodeInvalidArgument, "%s: command not found", prog)
	}
	return protocol.Errorf(protocol.CodeInvalidArgument, "%s: cannot run: %v", prog, errors.Unwrap(err))
}
