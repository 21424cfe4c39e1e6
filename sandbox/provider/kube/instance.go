package kube

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// instance is one running pod.
type instance struct {
	p      *Provider
	spec   provider.Spec
	name   string
	uid    string
	node   string
	ip     string
	client *agentClient
	env    map[string]string

	done     chan struct{}
	doneOnce sync.Once
	mu       sync.Mutex
	end      string // why the pod ended (for EndReason and errors)
	stopping bool
	cancel   context.CancelFunc
}

// Stop reasons the pod watcher records.
const (
	endDeleted = "the sandbox's pod was deleted"
)

func newInstance(p *Provider, spec provider.Spec, pod *corev1.Pod, secret []byte, pin *tls.Config) *instance {
	in := &instance{p: p, spec: spec, name: pod.Name, uid: string(pod.UID), node: pod.Spec.NodeName, ip: pod.Status.PodIP, done: make(chan struct{})}
	in.client = &agentClient{addr: net.JoinHostPort(in.ip, strconv.Itoa(agent.Port)), secret: secret, tls: pin, gone: in.goneErr}
	ctx, cancel := context.WithCancel(context.Background())
	in.cancel = cancel
	go in.watchPod(ctx, pod.ResourceVersion)
	return in
}

// goneErr is ErrStopped with the reason once the pod is gone, else nil.
func (in *instance) goneErr() error {
	select {
	case <-in.done:
		in.mu.Lock()
		defer in.mu.Unlock()
		if in.end == provider.ReasonMemoryLimit {
			return provider.ErrMemoryLimit
		}
		return fmt.Errorf("%w: %s", provider.ErrStopped, in.end)
	default:
		return nil
	}
}

func (in *instance) finish(why string) {
	in.doneOnce.Do(func() {
		in.mu.Lock()
		if in.end == "" {
			in.end = why
		}
		in.mu.Unlock()
		close(in.done)
		in.client.close()
	})
}

// connect waits for the agent's greeting (it listens a few milliseconds after the container
// starts) and reads the environment snapshot.
func (in *instance) connect(ctx context.Context) error {
	var last error
	for delay := 5 * time.Millisecond; ; delay = min(delay*2, 200*time.Millisecond) {
		var env []string
		err := in.client.unary(ctx, agent.OpEnv, nil, &env)
		if err == nil {
			in.env = map[string]string{}
			for _, kv := range env {
				if k, v, ok := strings.Cut(kv, "="); ok {
					in.env[k] = v
				}
			}
			return nil
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("the agent in pod %s did not answer: %v", in.name, last)
		case <-in.done:
			return in.goneErr()
		case <-time.After(delay):
		}
	}
}

// watchPod closes Done when the pod ends: deleted, evicted, its container exited or was killed
// (OOMKilled is the memory limit), or replaced by another pod of the same name.
func (in *instance) watchPod(ctx context.Context, rv string) {
	pods := in.p.cfg.Client.CoreV1().Pods(in.p.cfg.Namespace)
	for delay := 100 * time.Millisecond; ctx.Err() == nil; {
		w, err := pods.Watch(ctx, metav1.ListOptions{
			FieldSelector:   fields.OneTermEqualSelector("metadata.name", in.name).String(),
			ResourceVersion: rv,
		})
		if err != nil {
			// The API server is away or throttling: keep trying; an outage is not a stop.
			select {
			case <-ctx.Done():
				return
			case <-time.After(delay):
			}
			delay = min(delay*2, 5*time.Second)
			continue
		}
		delay = 100 * time.Millisecond
		for ev := range w.ResultChan() {
			switch ev.Type {
			case watch.Deleted:
				w.Stop()
				in.finish(endDeleted)
				return
			case watch.Error:
				// The version expired: read the pod afresh.
				rv = ""
				pod, err := pods.Get(ctx, in.name, metav1.GetOptions{})
				if apierrors.IsNotFound(err) {
					w.Stop()
					in.finish(endDeleted)
					return
				}
				if err == nil {
					rv = pod.ResourceVersion
					if why := in.podGone(pod); why != "" {
						w.Stop()
						in.finish(why)
						return
					}
				}
				continue
			}
			pod, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			rv = pod.ResourceVersion
			if why := in.podGone(pod); why != "" {
				w.Stop()
				in.finish(why)
				return
			}
		}
		w.Stop()
	}
}

// podGone says why this instance's pod no longer runs, or "".
func (in *instance) podGone(pod *corev1.Pod) string {
	if string(pod.UID) != in.uid {
		return "the sandbox's pod was replaced"
	}
	if pod.DeletionTimestamp != nil {
		return endDeleted
	}
	if podEnded(pod) {
		if pod.Status.Reason == "Evicted" {
			return "the sandbox's pod was evicted: " + pod.Status.Message
		}
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name != containerName {
			continue
		}
		if t := cs.State.Terminated; t != nil {
			if t.Reason == "OOMKilled" {
				return provider.ReasonMemoryLimit
			}
			return fmt.Sprintf("the sandbox's container exited (%s, code %d)", t.Reason, t.ExitCode)
		}
		if cs.RestartCount > 0 {
			return "the sandbox's container restarted"
		}
	}
	if podEnded(pod) {
		return fmt.Sprintf("the sandbox's pod ended (%s): %s %s", pod.Status.Phase, pod.Status.Reason, pod.Status.Message)
	}
	return ""
}

// EndReason is provider.ReasonMemoryLimit when the container was OOM-killed.
func (in *instance) EndReason() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.end == provider.ReasonMemoryLimit {
		return provider.ReasonMemoryLimit
	}
	return ""
}

// EndMessage says why the pod ended, with the cluster's reason (provider.EndMessage).
func (in *instance) EndMessage() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.end == provider.ReasonMemoryLimit {
		return "the sandbox's container was OOM-killed at its memory limit"
	}
	return in.end
}

// Node and Pod say where the sandbox runs.
func (in *instance) Node() string { return in.node }
func (in *instance) Pod() string  { return in.p.cfg.Namespace + "/" + in.name }

func (in *instance) Environment() map[string]string { return in.env }

func (in *instance) Done() <-chan struct{} { return in.done }

// Files are the sandbox's file operations, served by its agent.
func (in *instance) Files() sandbox.Files { return agentFiles{in.client} }

// Stop deletes the pod (the claim stays) and waits until it is gone, within cleanupTimeout.
func (in *instance) Stop(ctx context.Context) error {
	in.mu.Lock()
	in.stopping = true
	in.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
	defer cancel()
	err := in.p.deletePod(ctx, in.name, 0)
	in.cancel()
	in.finish("the sandbox was stopped")
	return err
}

// Exec runs one command through the agent.
func (in *instance) Exec(ctx context.Context, req provider.ExecRequest) (provider.ExecResult, error) {
	argv, env, cwd, timeout, err := provider.PrepareExec(req, in.spec.Template.Limits)
	if err != nil {
		return provider.ExecResult{}, err
	}
	if err := in.goneErr(); err != nil {
		return provider.ExecResult{}, err
	}
	args := agent.ExecArgs{
		Argv: argv, Dir: cwd, Env: env, Stdin: req.Stdin != nil, Stdout: req.Stdout != nil, Stderr: req.Stderr != nil,
		MaxOutput: req.MaxOutput, TimeoutMs: timeout.Milliseconds(), Background: req.Background,
	}
	if req.TTY != nil {
		return in.execTTY(ctx, req, args)
	}
	c, _, err := in.client.stream(ctx, agent.OpExec, args)
	if err != nil {
		return provider.ExecResult{}, err
	}
	defer c.Close()
	// A broken connection or a stopped pod ends the wait.
	finished := make(chan struct{})
	defer close(finished)
	stopGuard := in.guard(ctx, c, finished)
	defer stopGuard()
	var stdinDone chan struct{}
	for {
		typ, p, err := c.read()
		if err != nil {
			return in.brokenExec(ctx, err)
		}
		switch typ {
		case agent.FrameStarted:
			if req.Stdin != nil && stdinDone == nil {
				stdinDone = make(chan struct{})
				go func() {
					defer close(stdinDone)
					buf := make([]byte, 32<<10)
					for {
						n, rerr := req.Stdin.Read(buf)
						if n > 0 && c.write(agent.FrameStdin, buf[:n]) != nil {
							return
						}
						if rerr != nil {
							c.write(agent.FrameStdinEOF, nil)
							return
						}
					}
				}()
			}
		case agent.FrameStdout:
			if req.Stdout != nil {
				req.Stdout.Write(p)
			}
		case agent.FrameStderr:
			if req.Stderr != nil {
				req.Stderr.Write(p)
			} else if req.Stdout != nil {
				req.Stdout.Write(p)
			}
		case agent.FrameResult:
			res, err := execResult(p)
			if err == nil && stdinDone != nil {
				select {
				case <-stdinDone:
				case <-time.After(time.Second):
				}
			}
			return res, err
		}
	}
}
