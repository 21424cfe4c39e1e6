package kube

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// A pod lives on without the broker that made it, and so do its agent and every command it runs:
// a broker that stops lets go of its pods (Detach), and its next start takes each back (Adopt)
// instead of making it again, so a restart or a rolling update of the brokers loses none of a
// sandbox's processes (provider.Outliving).

var _ provider.Outliving = (*Provider)(nil)

// adoptTimeout bounds taking a pod back: reading it and its Secret, and its agent's answer.
const adoptTimeout = 30 * time.Second

// adoptAgentWait is how long the agent of a pod taken back has to answer: it has been up all along.
const adoptAgentWait = 10 * time.Second

// Adopt takes back the pod of spec's sandbox that an earlier run of this broker left running: only
// the pod made for it (named and labelled for this sandbox and this broker, mounting its Secret),
// running and Ready with its container never restarted, whose agent passes the sandbox's TLS pin
// and proves it holds its secret. Any other pod of that name is deleted, and a
// *provider.NotAdoptedError says why, so that Start makes a new one; the API server's own errors
// delete nothing.
func (p *Provider) Adopt(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	ctx, cancel := context.WithTimeout(ctx, adoptTimeout)
	defer cancel()
	name := PodName(spec.ID)
	in, err := p.adopt(ctx, spec, name)
	var na *provider.NotAdoptedError
	if errors.As(err, &na) && na.Reason != notThere {
		// Its own bound: the adoption's may be spent, and a throttling API server is retried
		// for as long as the context lasts.
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer dcancel()
		if derr := p.deletePod(dctx, name, 0); derr != nil {
			return nil, fmt.Errorf("deleting pod %s, which could not be taken back (%s): %w", name, na.Reason, derr)
		}
	}
	if err != nil {
		return nil, err
	}
	return in, nil
}

const notThere = "its pod is gone"

func (p *Provider) adopt(ctx context.Context, spec provider.Spec, name string) (*instance, error) {
	not := func(format string, args ...any) error {
		return &provider.NotAdoptedError{Reason: fmt.Sprintf(format, args...)}
	}
	pod, err := p.cfg.Client.CoreV1().Pods(p.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, not(notThere)
	case err != nil:
		return nil, fmt.Errorf("reading pod %s/%s: %w", p.cfg.Namespace, name, err)
	}
	if why := p.notOurs(pod, spec); why != "" {
		return nil, not("pod %s is not the one made for it: %s", name, why)
	}
	if why := notUp(pod); why != "" {
		return nil, not("pod %s %s", name, why)
	}
	sec, err := p.cfg.Client.CoreV1().Secrets(p.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, not("its Secret %s is gone", name)
	case err != nil:
		return nil, fmt.Errorf("the sandbox's agent secret %s/%s: %w", p.cfg.Namespace, name, err)
	}
	secret := sec.Data[secretKey]
	if len(secret) < 16 {
		return nil, not("its Secret %s holds no usable %q key", name, secretKey)
	}
	if len(sec.Data[agent.CertFile]) == 0 || len(sec.Data[agent.KeyFile]) == 0 {
		// Start adds one; the agent running now started without it.
		return nil, not("its Secret %s has no TLS key (made before the agent channel had TLS)", name)
	}
	pin, err := agent.ClientTLS(sec.Data[agent.CertFile])
	if err != nil {
		return nil, not("its Secret %s: %v", name, err)
	}
	if spec.Org != "" && sec.Annotations[annotationOrg] != spec.Org {
		// A pooled sandbox whose claim could not name its owner, as Start does.
		if err := p.Claimed(ctx, spec); err != nil {
			return nil, err
		}
	}
	in := newInstance(p, spec, pod, secret, pin)
	actx, cancel := context.WithTimeout(ctx, adoptAgentWait)
	defer cancel()
	if err := in.connect(actx); err != nil {
		in.cancel()
		in.finish("its agent did not prove itself")
		return nil, not("its agent did not prove itself: %v", err)
	}
	return in, nil
}

// notOurs says why pod is not the one this provider made for spec's sandbox, or "".
func (p *Provider) notOurs(pod *corev1.Pod, spec provider.Spec) string {
	want := p.labels(provider.Spec{ID: spec.ID})
	for _, k := range []string{LabelManaged, LabelBroker, LabelID} {
		if pod.Labels[k] != want[k] {
			return fmt.Sprintf("label %s is %q, not %q", k, pod.Labels[k], want[k])
		}
	}
	for _, v := range pod.Spec.Volumes {
		if v.Name == "agent" {
			if v.Secret == nil || v.Secret.SecretName != pod.Name {
				return "it does not mount the sandbox's Secret"
			}
			return ""
		}
	}
	return "it does not mount the sandbox's Secret"
}

// notUp says why pod is not running as a sandbox's pod that never stopped does, or "".
func notUp(pod *corev1.Pod) string {
	if pod.DeletionTimestamp != nil {
		return "is being deleted"
	}
	if pod.Status.Phase != corev1.PodRunning || pod.Status.PodIP == "" {
		return fmt.Sprintf("is not running (phase %s%s)", pod.Status.Phase, strings.TrimSpace(" "+pod.Status.Reason))
	}
	ready := false
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			ready = c.Status == corev1.ConditionTrue
		}
	}
	if !ready {
		return "is not Ready"
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == containerName {
			if cs.State.Running == nil {
				return "has its container not running"
			}
			if cs.RestartCount > 0 {
				return "has had its container restarted (its processes were lost)"
			}
			return ""
		}
	}
	return "has no sandbox container"
}

// Detach lets go of a pod without deleting it: its watch and its agent connections end, its
// Done closes (provider.Outliving).
func (p *Provider) Detach(inst provider.Instance) {
	in, ok := inst.(*instance)
	if !ok {
		return
	}
	in.cancel()
	in.finish("the broker let go of the sandbox's pod, which runs on")
}
