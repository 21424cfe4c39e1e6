package kube

import (
	"context"
	"errors"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/sbxbroker/broker/sandbox/provider"
)

// cleanupTimeout bounds what the provider removes for a caller that set no deadline (a delete
// detached from its request, the warm pool's discard) and a failed start's own cleanup: the API
// calls are sent again for as long as their context lasts while the API server throttles
// (throttle.go), so without a bound they would wait as long as the throttling does, holding the
// sandbox's lifecycle lock. A stop is held to it too (instance.Stop), and so are the broker start's
// listing and ending of pods left unclaimed (Unclaimed, EndRuntime), which would hold the start.
var cleanupTimeout = time.Minute

// deletePod deletes a pod and waits until it is gone.
func (p *Provider) deletePod(ctx context.Context, name string, grace int64) error {
	pods := p.cfg.Client.CoreV1().Pods(p.cfg.Namespace)
	err := pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for {
		pod, err := pods.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		w, err := pods.Watch(ctx, metav1.ListOptions{
			FieldSelector:   fields.OneTermEqualSelector("metadata.name", name).String(),
			ResourceVersion: pod.ResourceVersion,
		})
		if err != nil {
			return err
		}
		gone := false
	events:
		for {
			select {
			case <-ctx.Done():
				w.Stop()
				return fmt.Errorf("pod %s not gone: %w", name, ctx.Err())
			case ev, ok := <-w.ResultChan():
				if !ok {
					break events
				}
				if ev.Type == watch.Deleted {
					gone = true
					break events
				}
			}
		}
		w.Stop()
		if gone {
			return nil
		}
	}
}

// Destroy deletes the pod, the claim, the network policy and the secret, within cleanupTimeout
// whatever its caller's context allows.
func (p *Provider) Destroy(ctx context.Context, spec provider.Spec) error {
	ctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
	defer cancel()
	name := PodName(spec.ID)
	ns := p.cfg.Namespace
	c := p.cfg.Client
	if err := p.deletePod(ctx, name, 0); err != nil {
		return fmt.Errorf("deleting pod %s/%s: %w", ns, name, err)
	}
	var errs []error
	ignore := func(err error) {
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	ignore(c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, name, metav1.DeleteOptions{}))
	ignore(c.NetworkingV1().NetworkPolicies(ns).Delete(ctx, name, metav1.DeleteOptions{}))
	ignore(c.CoreV1().Secrets(ns).Delete(ctx, name, metav1.DeleteOptions{}))
	return errors.Join(errs...)
}
