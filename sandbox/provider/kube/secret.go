package kube

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// The sandbox's Secret holds what its agent needs, mounted read-only at /run/sbx in the pod and
// nowhere else (never in the pod spec, an env var, an event, a log or an error): the 32-byte
// secret (the challenge-response both ways), and the sandbox's own TLS key and self-signed
// certificate (agent.CertFile, agent.KeyFile), which the broker pins when it dials.

const secretKey = "secret"

// newAgentSecret is a new sandbox's Secret data.
func newAgentSecret() (map[string][]byte, error) {
	secret := make([]byte, 32)
	rand.Read(secret)
	data := map[string][]byte{secretKey: []byte(hex.EncodeToString(secret))}
	if err := addTLS(data); err != nil {
		return nil, err
	}
	return data, nil
}

func addTLS(data map[string][]byte) error {
	cert, key, err := agent.NewCredentials()
	if err != nil {
		return fmt.Errorf("making the sandbox's TLS key: %w", err)
	}
	data[agent.CertFile], data[agent.KeyFile] = cert, key
	return nil
}

// createSecret makes the sandbox's Secret; an existing one is kept.
func (p *Provider) createSecret(ctx context.Context, spec provider.Spec) error {
	data, err := newAgentSecret()
	if err != nil {
		return err
	}
	_, err = p.cfg.Client.CoreV1().Secrets(p.cfg.Namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: p.meta(spec),
		Type:       corev1.SecretTypeOpaque,
		Data:       data,
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("the sandbox's agent secret: %w", err)
	}
	return nil
}

// agentSecret reads the sandbox's Secret: the agent's secret and the TLS that pins its
// certificate. A Secret made before the agent channel had TLS holds no key: it gets one here
// (upgraded), and the caller replaces any pod made before, whose agent started without it (the
// broker never talks to an agent in clear).
func (p *Provider) agentSecret(ctx context.Context, name string) (sec *corev1.Secret, secret []byte, pin *tls.Config, upgraded bool, err error) {
	secrets := p.cfg.Client.CoreV1().Secrets(p.cfg.Namespace)
	sec, err = secrets.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, nil, nil, false, fmt.Errorf("the sandbox's agent secret %s/%s: %w", p.cfg.Namespace, name, err)
	}
	secret = sec.Data[secretKey]
	if len(secret) < 16 {
		return nil, nil, nil, false, fmt.Errorf("the sandbox's agent secret %s/%s holds no usable %q key", p.cfg.Namespace, name, secretKey)
	}
	if len(sec.Data[agent.CertFile]) == 0 || len(sec.Data[agent.KeyFile]) == 0 {
		if err := addTLS(sec.Data); err != nil {
			return nil, nil, nil, false, err
		}
		// An update, not a patch: it fails on a Secret changed meanwhile (another broker adding
		// its own key), and the start fails rather than pin a key the Secret no longer holds.
		if sec, err = secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
			return nil, nil, nil, false, fmt.Errorf("adding a TLS key to the sandbox's agent secret %s/%s (made before the agent channel had TLS): %w", p.cfg.Namespace, name, err)
		}
		p.cfg.Log.Info("added a TLS key to a sandbox's agent secret made before the agent channel had TLS; its pod, if any, is replaced", "secret", name)
		upgraded = true
	}
	pin, err = agent.ClientTLS(sec.Data[agent.CertFile])
	if err != nil {
		return nil, nil, nil, false, fmt.Errorf("the sandbox's agent secret %s/%s: %w", p.cfg.Namespace, name, err)
	}
	return sec, secret, pin, upgraded, nil
}
