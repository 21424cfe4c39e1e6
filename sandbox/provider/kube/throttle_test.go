package kube

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	flowcontrolv1 "k8s.io/api/flowcontrol/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/tests/wait"
)

// throttledUser is the identity the throttled broker acts as (the admin impersonates it: the test
// cluster's admin is in system:masters, which API Priority and Fairness exempts).
const throttledUser = "sbx-throttled-broker"

// apfJail makes the real API server answer 429 to every request of throttledUser while it is on:
// a PriorityLevelConfiguration with no concurrency of its own and none to borrow, requests
// rejected rather than queued, a FlowSchema sending the user there, and one request of the user's
// held open in it (a create whose body never comes: APF admits a request to a level with nothing
// executing, however small its limit, so the level must hold one). Off deletes the FlowSchema and
// ends the held request. Everything goes when the test ends.
func apfJail(t *testing.T, admin kubernetes.Interface, user *rest.Config) (throttle func(on bool)) {
	t.Helper()
	ctx := context.Background()
	fc := admin.FlowcontrolV1()
	zero := int32(0)
	pl := &flowcontrolv1.PriorityLevelConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "sbx-jail"},
		Spec: flowcontrolv1.PriorityLevelConfigurationSpec{Type: flowcontrolv1.PriorityLevelEnablementLimited,
			Limited: &flowcontrolv1.LimitedPriorityLevelConfiguration{
				NominalConcurrencyShares: &zero, LendablePercent: &zero, BorrowingLimitPercent: &zero,
				LimitResponse: flowcontrolv1.LimitResponse{Type: flowcontrolv1.LimitResponseTypeReject},
			}},
	}
	pl, err := fc.PriorityLevelConfigurations().Create(ctx, pl, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	crb := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "sbx-throttled-broker"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "cluster-admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: throttledUser}},
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	fs := &flowcontrolv1.FlowSchema{
		ObjectMeta: metav1.ObjectMeta{Name: "sbx-jail"},
		Spec: flowcontrolv1.FlowSchemaSpec{
			PriorityLevelConfiguration: flowcontrolv1.PriorityLevelConfigurationReference{Name: "sbx-jail"},
			MatchingPrecedence:         100,
			DistinguisherMethod:        &flowcontrolv1.FlowDistinguisherMethod{Type: flowcontrolv1.FlowDistinguisherMethodByUserType},
			Rules: []flowcontrolv1.PolicyRulesWithSubjects{{
				Subjects: []flowcontrolv1.Subject{{Kind: flowcontrolv1.SubjectKindUser, User: &flowcontrolv1.UserSubject{Name: throttledUser}}},
				ResourceRules: []flowcontrolv1.ResourcePolicyRule{{Verbs: []string{"*"}, APIGroups: []string{"*"}, Resources: []string{"*"},
					ClusterScope: true, Namespaces: []string{"*"}}},
				NonResourceRules: []flowcontrolv1.NonResourcePolicyRule{{Verbs: []string{"*"}, NonResourceURLs: []string{"*"}}},
			}},
		},
	}
	rt, err := rest.TransportFor(user)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: rt}
	level := func() string { // the priority level a request of the user lands in; "" when refused
		resp, err := hc.Get(user.Host + "/api/v1/namespaces/default/configmaps?limit=1")
		if err != nil {
			return ""
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusTooManyRequests {
			return ""
		}
		return resp.Header.Get("X-Kubernetes-Pf-Prioritylevel-Uid")
	}
	var plug *io.PipeWriter
	var plugDone chan struct{}
	off := func() {
		fc.FlowSchemas().Delete(ctx, fs.Name, metav1.DeleteOptions{})
		if plug != nil {
			plug.CloseWithError(errors.New("throttling off"))
			<-plugDone
			plug = nil
		}
	}
	t.Cleanup(func() {
		off()
		fc.PriorityLevelConfigurations().Delete(ctx, pl.Name, metav1.DeleteOptions{})
		admin.RbacV1().ClusterRoleBindings().Delete(ctx, crb.Name, metav1.DeleteOptions{})
	})
	return func(on bool) {
		t.Helper()
		if !on {
			off()
			return
		}
		if _, err := fc.FlowSchemas().Create(ctx, fs, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		wait.Eventually(t, 30*time.Second, func() bool { return level() == string(pl.UID) }, "the user's requests landing in the jail")
		// The held request is itself refused while another of the user's is still executing
		// (one just answered may not have left the level yet): send it again until it holds.
		for attempt := 0; ; attempt++ {
			pr, pw := io.Pipe()
			done := make(chan struct{})
			plug, plugDone = pw, done
			req, _ := http.NewRequest("POST", user.Host+"/api/v1/namespaces/default/configmaps", pr)
			req.Header.Set("Content-Type", "application/json")
			go func() {
				defer close(done)
				if resp, err := hc.Do(req); err == nil {
					resp.Body.Close()
				}
			}()
			held := wait.Until(10*time.Second, func() bool {
				select {
				case <-done:
					return true
				default:
				}
				return level() == "" // refused: no answer header is needed, a 429 is enough
			})
			select {
			case <-done:
				held = false
			default:
			}
			if held {
				return
			}
			pw.Close()
			<-done
			if attempt == 30 {
				t.Fatal("could not hold a request in the jail")
			}
			// Another of the user's requests held the seat (a start's retried calls, under a
			// loaded machine): send the plug again once a request of the user is admitted.
			wait.Until(5*time.Second, func() bool { return level() != "" })
		}
	}
}

// counted429 counts the 429s the API server answers, below client-go's own retries.
type counted429 struct {
	rt http.RoundTripper
	n  *atomic.Int64
}

func (c counted429) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.rt.RoundTrip(r)
	if err == nil && resp.StatusCode == http.StatusTooManyRequests {
		c.n.Add(1)
	}
	return resp, err
}

// TestAPIServerThrottling: the real API server throttles the broker (API Priority and Fairness
// answering 429 to its user). A create made while it throttles is retried, past client-go's own
// ten retries, and succeeds once the throttling ends; a running pod's instance is not ended by it;
// a call under throttling that never ends fails when its caller's context does, saying the API
// server throttled it.
func TestAPIServerThrottling(t *testing.T) {
	c := cluster(t)
	// The test cluster's API server runs without API Priority and Fairness; a second one on the
	// same etcd runs with it, and the throttled broker talks to that one.
	apf := apfServer(t, c)
	admin, err := kubernetes.NewForConfig(apf)
	if err != nil {
		t.Fatal(err)
	}
	var seen429 atomic.Int64
	cfg := rest.CopyConfig(apf)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: throttledUser}
	throttle := apfJail(t, admin, rest.CopyConfig(cfg))
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return counted429{rt, &seen429} })
	probe, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	client, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p, err := New(ctx, Config{Client: client, Namespace: "default", Broker: "throttled-broker", Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass})
	if err != nil {
		t.Fatal(err)
	}
	throttled := func() bool {
		err := probe.CoreV1().RESTClient().Get().Namespace("default").Resource("pods").MaxRetries(0).Do(ctx).Error()
		return apierrors.IsTooManyRequests(err)
	}
	throttle(true)
	wait.Eventually(t, 30*time.Second, throttled, "the API server throttling %s", throttledUser)

	// A create under throttling outlives client-go's own retries (ten), then succeeds once the
	// throttling ends.
	spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "t"}}
	defer p.Destroy(context.Background(), spec)
	before := seen429.Load()
	created := make(chan error, 1)
	go func() {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		created <- p.Create(cctx, spec)
	}()
	// client-go alone gives up after its first try and ten retries: eleven 429s.
	wait.Eventually(t, 50*time.Second, func() bool { return seen429.Load()-before > 11 }, "the create retried past client-go's ten retries")
	select {
	case err := <-created:
		t.Fatalf("the create ended while the API server still throttled: %v", err)
	default:
	}
	throttle(false)
	if err := <-created; err != nil {
		t.Fatalf("the create once the throttling ended: %v", err)
	}
	wait.Eventually(t, 30*time.Second, func() bool { return !throttled() }, "the throttling ending")
	in, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Stop(context.Background())

	// Throttled again: the running sandbox goes on (its dataplane never meets the API server),
	// and a call that is never let through fails with its caller's context, saying why.
	throttle(true)
	wait.Eventually(t, 30*time.Second, throttled, "the API server throttling again")
	before = seen429.Load()
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	t0 := time.Now()
	_, err = p.Runtimes(lctx)
	if !apierrors.IsTooManyRequests(err) {
		t.Fatalf("listing under endless throttling: %v, want the API server's 429", err)
	}
	// It gives up once the next wait would pass the context's end (at most throttleMaxWait and
	// its jitter before it), having tried again meanwhile.
	if took := time.Since(t0); took < 5*time.Second-throttleMaxWait*3/2 || seen429.Load()-before < 2 {
		t.Fatalf("the list gave up after %s and %d 429s, within a 5 s context", took, seen429.Load()-before)
	}
	t.Logf("listing under throttling: %v", err)
	select {
	case <-in.Done():
		t.Fatal("the throttling ended the running sandbox")
	default:
	}
	var out strings.Builder
	if res, err := in.Exec(ctx, provider.ExecRequest{Command: "echo still", Stdout: &out}); err != nil || res.ExitCode != 0 || out.String() != "still\n" {
		t.Fatalf("exec under throttling: %v %+v %q", err, res, out.String())
	}
	throttle(false)
}

// apfServer starts a second kube-apiserver of the test cluster, on its etcd, with API Priority and
// Fairness on (the cluster's own runs with it off), and answers the admin's config for it. It is
// stopped when the test ends.
func apfServer(t *testing.T, c *kubetest.Cluster) *rest.Config {
	t.Helper()
	bin, err := kubetest.Binaries()
	if err != nil {
		t.Fatal(err)
	}
	// The cluster's API server's etcd, from its command line.
	etcd := ""
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range procs {
		b, _ := os.ReadFile(f)
		args := strings.Split(string(b), "\x00")
		if len(args) == 0 || filepath.Base(args[0]) != "kube-apiserver" || !slices.Contains(args, "--cert-dir="+filepath.Join(c.Dir, "certs")) {
			continue
		}
		for _, a := range args {
			if v, ok := strings.CutPrefix(a, "--etcd-servers="); ok {
				etcd = v
			}
		}
	}
	if etcd == "" {
		t.Fatal("the test cluster's kube-apiserver (and its etcd) not found")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	dir := t.TempDir()
	logf, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(bin, "kube-apiserver"), "--etcd-servers="+etcd,
		"--cert-dir="+filepath.Join(dir, "certs"), "--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", port),
		"--token-auth-file="+filepath.Join(c.Dir, "tokens.csv"), "--authorization-mode=Node,RBAC",
		"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file="+filepath.Join(c.Dir, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(c.Dir, "sa.key"), "--service-cluster-ip-range=10.96.0.0/16",
		"--enable-priority-and-fairness=true", "--endpoint-reconciler-type=none", "--profiling=false")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	})
	cfg := rest.CopyConfig(c.Config)
	cfg.Host = fmt.Sprintf("https://127.0.0.1:%d", port)
	cfg.TLSClientConfig = rest.TLSClientConfig{Insecure: true}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ok := wait.Until(60*time.Second, func() bool {
		select {
		case <-exited:
			return true
		default:
		}
		b, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		return err == nil && string(b) == "ok"
	})
	select {
	case <-exited:
		ok = false
	default:
	}
	if !ok {
		b, _ := os.ReadFile(filepath.Join(dir, "log"))
		t.Fatalf("the second kube-apiserver did not get ready:\n%s", tail(b, 3000))
	}
	return cfg
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// TestThrottlingNeverHoldsACleanupForever: a delete made without a deadline (the API's delete
// detaches from its request so that a client's disconnect leaves nothing half done; the warm pool
// discards with none), and a failed start's own cleanup (detached from the start's context), must
// end while the API server throttles on, with the server's 429: the retry layer waits only as long
// as its caller's context, and these had none, so they waited for as long as the throttling
// lasted, holding the sandbox's lifecycle lock, where client-go alone had given up after ten
// retries.
func TestThrottlingNeverHoldsACleanupForever(t *testing.T) {
	c := cluster(t)
	apf := apfServer(t, c)
	admin, err := kubernetes.NewForConfig(apf)
	if err != nil {
		t.Fatal(err)
	}
	cfg := rest.CopyConfig(apf)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: throttledUser}
	throttle := apfJail(t, admin, rest.CopyConfig(cfg))
	probe, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	client, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const startTimeout = 40 * time.Second
	p, err := New(ctx, Config{Client: client, Namespace: "default", Broker: "throttled-broker", Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass, StartTimeout: startTimeout})
	if err != nil {
		t.Fatal(err)
	}
	throttled := func() bool {
		err := probe.CoreV1().RESTClient().Get().Namespace("default").Resource("pods").MaxRetries(0).Do(ctx).Error()
		return apierrors.IsTooManyRequests(err)
	}
	defer func(d time.Duration) { cleanupTimeout = d }(cleanupTimeout)
	cleanupTimeout = 5 * time.Second
	// What a bounded call may take past its bound: its last wait and jitter, and the request.
	const slack = 3*throttleMaxWait + 5*time.Second

	// A delete without a deadline.
	spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "t"}}
	defer p.Destroy(context.Background(), spec)
	if err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	throttle(true)
	wait.Eventually(t, 30*time.Second, throttled, "the API server throttling %s", throttledUser)
	destroyed := make(chan error, 1)
	t0 := time.Now()
	go func() { destroyed <- p.Destroy(context.Background(), spec) }()
	select {
	case err := <-destroyed:
		if !apierrors.IsTooManyRequests(err) {
			t.Fatalf("a delete under endless throttling: %v, want the API server's 429", err)
		}
		t.Logf("a delete under endless throttling ended after %s: %v", time.Since(t0).Round(time.Millisecond), err)
	case <-time.After(cleanupTimeout + slack):
		t.Fatalf("a delete without a deadline still waits %s into endless throttling", time.Since(t0).Round(time.Second))
	}
	throttle(false)
	wait.Eventually(t, 30*time.Second, func() bool { return !throttled() }, "the throttling ending")

	// A start that fails (no node matches its selector) while the API server throttles: it may
	// take its whole start timeout (its calls are retried for as long as it lasts), but its
	// cleanup, detached from it, ends too, and the start with it.
	stuck := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "t",
		Kubernetes: &provider.KubernetesTemplate{NodeSelector: map[string]string{"sbx.dev/no-such-node": "x"}}}}
	defer p.Destroy(context.Background(), stuck)
	if err := p.Create(ctx, stuck); err != nil {
		t.Fatal(err)
	}
	started := make(chan error, 1)
	tStart := time.Now()
	go func() {
		_, err := p.Start(ctx, stuck)
		started <- err
	}()
	wait.Eventually(t, 60*time.Second, func() bool {
		pod, err := admin.CoreV1().Pods("default").Get(ctx, PodName(stuck.ID), metav1.GetOptions{})
		if err != nil {
			return false
		}
		_, err = podStartState(pod)
		var ue *unschedulableError
		return errors.As(err, &ue)
	}, "the pod found unschedulable")
	throttle(true)
	wait.Eventually(t, 30*time.Second, throttled, "the API server throttling again")
	select {
	case err := <-started:
		if err == nil {
			t.Fatal("a start with no node for its pod succeeded")
		}
		t.Logf("a failed start under throttling ended %s after it began: %v", time.Since(tStart).Round(time.Millisecond), err)
	case <-time.After(time.Until(tStart.Add(startTimeout + cleanupTimeout + slack))):
		t.Fatalf("a failed start still waits on its cleanup %s after it began (its timeout %s), in endless throttling", time.Since(tStart).Round(time.Second), startTimeout)
	}

	// The broker's start lists the pooled pods an earlier broker left (sandbox's recoverUnclaimed)
	// and ends those its data dir does not know, with no deadline of its own: under endless
	// throttling neither may hold the broker's start.
	for _, call := range []struct {
		what string
		fn   func() error
	}{
		{"listing the pods left unclaimed", func() error { _, err := p.Unclaimed(context.Background()); return err }},
		{"ending a pod left unclaimed", func() error { return p.EndRuntime(context.Background(), spec.ID) }},
	} {
		ended := make(chan error, 1)
		t0 := time.Now()
		go func() { ended <- call.fn() }()
		select {
		case err := <-ended:
			if !apierrors.IsTooManyRequests(err) {
				t.Fatalf("%s under endless throttling: %v, want the API server's 429", call.what, err)
			}
			t.Logf("%s under endless throttling ended after %s: %v", call.what, time.Since(t0).Round(time.Millisecond), err)
		case <-time.After(cleanupTimeout + slack):
			t.Fatalf("%s without a deadline still waits %s into endless throttling", call.what, time.Since(t0).Round(time.Second))
		}
	}
	throttle(false)
}
