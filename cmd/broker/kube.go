package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/spf13/pflag"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
)

// kubeConfig is the kubernetes provider's part of the configuration (--provider kubernetes).
type kubeConfig struct {
	Kubeconfig      string
	Namespace       string
	Image           string
	PullPolicy      string
	StorageClass    string
	NetworkPolicies bool
	AgentFrom       []string
}

func init() {
	for flag, env := range map[string]string{
		"kubeconfig": "SBX_KUBECONFIG", "namespace": "SBX_KUBE_NAMESPACE", "kube-image": "SBX_KUBE_IMAGE",
		"kube-pull-policy": "SBX_KUBE_PULL_POLICY", "kube-storage-class": "SBX_KUBE_STORAGE_CLASS",
		"kube-network-policies": "SBX_KUBE_NETWORK_POLICIES", "kube-agent-from": "SBX_KUBE_AGENT_FROM",
	} {
		envOf[flag] = env
	}
}

func kubeFlags(fs *pflag.FlagSet, c *config) {
	fs.StringVar(&c.Kube.Kubeconfig, "kubeconfig", "", "--provider kubernetes: kubeconfig file of the cluster sandboxes run on (default: the in-cluster config of the pod the broker runs in)")
	fs.StringVar(&c.Kube.Namespace, "namespace", "", "--provider kubernetes: namespace of the sandboxes' pods, claims and secrets (default: the kubeconfig context's; in a pod without --kubeconfig, the pod's own; else \"default\")")
	fs.StringVar(&c.Kube.Image, "kube-image", "", "--provider kubernetes: sandbox image; its entrypoint runs sbx-agent (cmd/sbx-agent) (docs/operations.md, Running on Kubernetes)")
	fs.StringVar(&c.Kube.PullPolicy, "kube-pull-policy", "IfNotPresent", "--provider kubernetes: the sandbox image's pull policy: Always, IfNotPresent or Never")
	fs.StringVar(&c.Kube.StorageClass, "kube-storage-class", "", "--provider kubernetes: storage class of the workspaces' claims (default: the cluster's default class)")
	fs.BoolVar(&c.Kube.NetworkPolicies, "kube-network-policies", true, "--provider kubernetes: give each sandbox a NetworkPolicy denying egress unless its template turns the network on and admitting only the brokers (--kube-agent-from) to its agent (enforced only by a CNI that implements NetworkPolicy)")
	fs.StringSliceVar(&c.Kube.AgentFrom, "kube-agent-from", nil, "--provider kubernetes: who the NetworkPolicy admits to the sandboxes' agents, comma-separated: CIDRs or IPs (the brokers' addresses as pods see them) and pod labels [NAMESPACE:]KEY=VALUE (default in a pod: the broker pods of its namespace, "+kube.BrokerPodLabel+"; outside: any source, with a warning)")
}

// validateKube checks the kubernetes flags.
func (c *config) validateKube(bad func(flag, format string, args ...any)) {
	if c.Provider != "kubernetes" {
		return
	}
	if c.Kube.Image == "" {
		bad("kube-image", "--provider kubernetes needs the sandbox image: one whose entrypoint runs sbx-agent (cmd/sbx-agent)")
	}
	switch corev1.PullPolicy(c.Kube.PullPolicy) {
	case corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever:
	default:
		bad("kube-pull-policy", "%q is not Always, IfNotPresent or Never", c.Kube.PullPolicy)
	}
	if _, err := kube.ParseAgentFrom(c.Kube.AgentFrom); err != nil {
		bad("kube-agent-from", "%v", err)
	}
}

// serviceAccountNamespace is where the namespace of the pod a broker runs in is mounted.
const serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// ownNamespace is the namespace in file (the pod's, mounted with its service account token), or ""
// when it cannot be read.
func ownNamespace(file string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// agentFrom is the peers admitted to the agents: --kube-agent-from, or by default, in a pod, the
// broker pods of its own namespace (the deploy manifests' label). Outside a cluster the address pods
// see a broker at depends on the network between them, so the default admits any source and says so.
func agentFrom(c *config, inCluster bool, log *slog.Logger) ([]networkingv1.NetworkPolicyPeer, error) {
	entries := c.Kube.AgentFrom
	if len(entries) == 0 && c.Kube.NetworkPolicies {
		if !inCluster {
			log.Warn("the sandboxes' NetworkPolicies admit any source to their agents' port (the agents still authenticate every connection); give the brokers' addresses as pods see them with --kube-agent-from")
			return nil, nil
		}
		ns, err := os.ReadFile(serviceAccountNamespace)
		if err != nil {
			return nil, fmt.Errorf("--kube-agent-from: the broker's own namespace (%v): give the brokers' pods or addresses", err)
		}
		entries = []string{strings.TrimSpace(string(ns)) + ":" + kube.BrokerPodLabel}
	}
	return kube.ParseAgentFrom(entries)
}

// kubeProvider connects to the cluster (the kubeconfig, or the in-cluster config) and returns the
// kubernetes provider.
func kubeProvider(ctx context.Context, c *config, node string, log *slog.Logger) (provider.Provider, provider.Report, error) {
	var cfg *rest.Config
	ns := c.Kube.Namespace
	var err error
	if c.Kube.Kubeconfig != "" {
		loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
			&clientcmd.ClientConfigLoadingRules{ExplicitPath: c.Kube.Kubeconfig}, &clientcmd.ConfigOverrides{})
		if cfg, err = loader.ClientConfig(); err != nil {
			return nil, provider.Report{}, fmt.Errorf("--kubeconfig (SBX_KUBECONFIG): %w", err)
		}
		if ns == "" {
			ns, _, _ = loader.Namespace()
		}
	} else if cfg, err = rest.InClusterConfig(); err != nil {
		return nil, provider.Report{}, fmt.Errorf("--provider kubernetes: no --kubeconfig and not running in a pod (%v): give the cluster's kubeconfig", err)
	} else if ns == "" {
		// The namespace the broker runs in, where its Role is and where its default
		// --kube-agent-from looks for the brokers.
		ns = ownNamespace(serviceAccountNamespace)
	}
	if ns == "" {
		ns = "default"
	}
	from, err := agentFrom(c, c.Kube.Kubeconfig == "", log)
	if err != nil {
		return nil, provider.Report{}, err
	}
	cs, err := kube.NewClient(cfg)
	if err != nil {
		return nil, provider.Report{}, err
	}
	p, err := kube.New(ctx, kube.Config{
		Client: cs, Namespace: ns, Broker: node, Image: c.Kube.Image, PullPolicy: corev1.PullPolicy(c.Kube.PullPolicy),
		StorageClass: c.Kube.StorageClass, NetworkPolicies: c.Kube.NetworkPolicies, AgentFrom: from, Log: log,
	})
	if err != nil {
		return nil, provider.Report{}, err
	}
	log.Info("sandboxes run as pods", "server", cfg.Host, "namespace", ns, "image", c.Kube.Image)
	return p, provider.Report{Provider: kube.Name, LimitsEnforced: true, LimitsReason: "enforced by the cluster (container resources)"}, nil
}
