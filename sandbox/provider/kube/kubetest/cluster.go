// Package kubetest starts a real single-node Kubernetes cluster for tests, from the parts
// /work/shared/KUBERNETES-LOCAL.md describes: etcd, containerd and runc from Debian (scripts/deps.sh),
// kube-apiserver, kubelet, kube-proxy, kube-scheduler and kube-controller-manager v1.32.4 built and
// cached by scripts/kube.sh, and images built here and imported into containerd (no registry).
// kube-proxy (iptables mode) makes Services' cluster IPs answer from pods and from the host; the API
// server listens on the node's address, so pods reach it through the `kubernetes` Service
// (APIServiceIP) with their in-cluster config; it reaches kubelet with a client certificate
// kubelet trusts (certs.go), so `kubectl exec` and `kubectl logs` work. Everything it starts
// listens on 127.0.0.1 or the machine's own address, keeps its state in one temporary directory,
// and is stopped and cleaned by Stop: processes by pid, the CNI bridge, the iptables chains
// kubelet, kube-proxy and the CNI plugins added, the sysctls kube-proxy may change, the pods'
// cgroups and mounts, the claims' directories.
//
// One cluster runs on a machine at a time (a file lock serializes test binaries that each want one).
package kubetest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Images the cluster has imported.
const (
	// PauseImage is the pod sandbox image containerd's CRI runs in every pod (kubetest/pause).
	PauseImage = "registry.k8s.io/pause:3.10"
	// SandboxImage holds the static sbx-agent (/sbx/sbx-agent, its entrypoint: the pod's resident init)
	// and busybox's userland (/bin/sh and the usual commands).
	SandboxImage = "sbx.local/sandbox:test"
	// BrokerImage holds the static broker binary (BrokerImageSpec); a test that needs it imports
	// it (BuildStatic, Import), as the deploy manifests' test (tests/deploy) does.
	BrokerImage = "sbx.local/broker:test"
	// StorageClass provisions claims as host directories through kube-controller-manager's
	// hostpath provisioner (a test-only provisioner: the directories live under /tmp/hostpath_pv).
	StorageClass = "sbx-hostpath"
	// Version is the Kubernetes version scripts/kube.sh builds.
	Version = "v1.32.4"
)

const bridgeName = "sbxkube0"

// Cluster is a running single-node cluster.
type Cluster struct {
	Dir        string // state, logs, kubeconfig
	Kubeconfig string
	Config     *rest.Config
	Client     kubernetes.Interface
	Node       string // the node's name
	NodeIP     string
	containerd string // its socket
	procs      []*proc
	lock       *os.File
	ipForward  []byte
	sysctls    map[string][]byte // what kube-proxy may change, as it was (proxy.go)
	// hostDirs are the entries of the host directories kubelet and the CNI plugins write to
	// (pod logs, network namespaces) before the cluster started: Stop removes the others.
	hostDirs map[string]map[string]bool
}

// hostDirs are the host directories the cluster writes into outside its state directory.
var hostDirs = []string{"/var/log/pods", "/var/log/containers", netnsDir}

// netnsDir holds the named network namespaces: the CNI plugin's pods' and any other program's.
const netnsDir = "/var/run/netns"

func listDir(d string) map[string]bool {
	m := map[string]bool{}
	ents, _ := os.ReadDir(d)
	for _, e := range ents {
		m[e.Name()] = true
	}
	return m
}

type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// RepoRoot is the broker repository's root (found from the working directory).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && bytes.HasPrefix(b, []byte("module github.com/sbxbroker/broker\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("kubetest: not inside the broker repository")
		}
		dir = parent
	}
}

// Binaries builds (first time: 10-18 minutes on 2 cores) or finds the cached Kubernetes binaries and
// returns their directory.
func Binaries() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.Command(filepath.Join(root, "scripts/kube.sh"), "build")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("kubetest: scripts/kube.sh build failed (run it by hand to see why): %v: %s", err, tail(stderr.Bytes(), 2000))
	}
	return strings.TrimSpace(string(out)), nil
}

func requireTools() error {
	var missing []string
	for _, t := range []string{"etcd", "containerd", "ctr", "runc", "iptables", "iptables-save", "iptables-restore", "conntrack", "ip"} {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		missing = append(missing, "/usr/lib/cni/bridge")
	}
	if len(missing) > 0 {
		return fmt.Errorf("kubetest: %s missing: run scripts/deps.sh (Debian etcd-server containerd runc containernetworking-plugins iptables conntrack iproute2)", strings.Join(missing, ", "))
	}
	if os.Getuid() != 0 {
		return errors.New("kubetest: a cluster needs root (kubelet, containerd and the CNI bridge)")
	}
	return nil
}

// Start starts a cluster and returns once its node is Ready, its images are imported, its default
// service account exists and its storage class is in place. On error everything started is stopped.
func Start(ctx context.Context) (c *Cluster, err error) {
	if err := requireTools(); err != nil {
		return nil, err
	}
	bin, err := Binaries()
	if err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(os.TempDir(), "sbx-kubetest.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		lock.Close()
		return nil, err
	}
	if err := sweepCrashedRun(); err != nil {
		lock.Close()
		return nil, err
	}
	c = &Cluster{lock: lock, hostDirs: map[string]map[string]bool{}}
	for _, d := range hostDirs {
		c.hostDirs[d] = listDir(d)
	}
	defer func() {
		if err != nil {
			if serr := c.Stop(); serr != nil {
				err = fmt.Errorf("%w (and stopping: %v)", err, serr)
			}
			c = nil
		}
	}()
	if c.Dir, err = os.MkdirTemp("", stateDirPrefix); err != nil {
		return c, err
	}
	if err := os.MkdirAll(filepath.Join(c.Dir, "logs"), 0o755); err != nil {
		return c, err
	}
	if c.NodeIP, err = nodeIP(); err != nil {
		return c, err
	}
	c.Node = "sbxkube-node"
	ports, err := freePorts(5)
	if err != nil {
		return c, err
	}
	etcdPort, etcdPeer, apiPort, kubeletPort, streamPort := ports[0], ports[1], ports[2], ports[3], ports[4]

	// etcd
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	if err := c.run("etcd", "etcd", "--data-dir", c.path("etcd"), "--listen-client-urls", etcdURL,
		"--advertise-client-urls", etcdURL, "--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer)); err != nil {
		return c, err
	}
	if err := c.waitPort("etcd", etcdPort, 30*time.Second); err != nil {
		return c, err
	}

	// kube-apiserver, with a static token for everyone here (admin, system:masters).
	token := randHex(16)
	if err := os.WriteFile(c.path("tokens.csv"), []byte(token+`,admin,admin,"system:masters"`+"\n"), 0o600); err != nil {
		return c, err
	}
	if err := writeSAKeys(c.path("sa.key"), c.path("sa.pub")); err != nil {
		return c, err
	}
	if err := writeKubeletClientCerts(c.path("kubelet-client-ca.crt"), c.path("apiserver-kubelet-client.crt"), c.path("apiserver-kubelet-client.key")); err != nil {
		return c, err
	}
	if err := c.run("kube-apiserver", filepath.Join(bin, "kube-apiserver"), "--etcd-servers="+etcdURL,
		"--cert-dir="+c.path("certs"), "--bind-address="+c.NodeIP, "--advertise-address="+c.NodeIP, fmt.Sprintf("--secure-port=%d", apiPort),
		"--token-auth-file="+c.path("tokens.csv"), "--authorization-mode=Node,RBAC",
		"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file="+c.path("sa.pub"),
		"--service-account-signing-key-file="+c.path("sa.key"), "--service-cluster-ip-range="+ServiceCIDR,
		"--kubelet-preferred-address-types=InternalIP,Hostname", "--enable-priority-and-fairness=false",
		"--kubelet-client-certificate="+c.path("apiserver-kubelet-client.crt"), "--kubelet-client-key="+c.path("apiserver-kubelet-client.key"),
		"--profiling=false", "--watch-cache=true"); err != nil {
		return c, err
	}
	// On the node's address, which pods reach too: the `kubernetes` Service leads there, so a
	// program in a pod can use its in-cluster config.
	server := fmt.Sprintf("https://%s", net.JoinHostPort(c.NodeIP, fmt.Sprint(apiPort)))
	c.Kubeconfig = c.path("kubeconfig")
	if err := os.WriteFile(c.Kubeconfig, []byte(kubeconfig(server, token)), 0o600); err != nil {
		return c, err
	}
	if c.Config, err = clientcmd.BuildConfigFromFlags("", c.Kubeconfig); err != nil {
		return c, err
	}
	c.Config.QPS, c.Config.Burst = 100, 200
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		return c, err
	}
	if err := c.until(ctx, "kube-apiserver /readyz", 90*time.Second, func() (bool, error) {
		b, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil && string(b) == "ok", nil
	}); err != nil {
		return c, err
	}

	// containerd, with its own config: runc, the CNI bridge, restrict_oom_score_adj (these machines
	// lack CAP_SYS_RESOURCE: without it every pod fails starting its pause container).
	c.containerd = c.path("containerd.sock")
	if err := c.writeContainerdConfig(streamPort); err != nil {
		return c, err
	}
	if err := c.run("containerd", "containerd", "--config", c.path("containerd.toml")); err != nil {
		return c, err
	}
	if err := c.until(ctx, "containerd's socket", 30*time.Second, func() (bool, error) {
		conn, err := net.Dial("unix", c.containerd)
		if err == nil {
			conn.Close()
		}
		return err == nil, nil
	}); err != nil {
		return c, err
	}
	if err := c.importImages(ctx); err != nil {
		return c, err
	}

	// The CNI bridge forwards pod traffic.
	if c.ipForward, err = os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil {
		return c, err
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1\n"), 0o644); err != nil {
		return c, err
	}

	// kubelet
	if err := c.writeKubeletConfig(kubeletPort); err != nil {
		return c, err
	}
	if err := c.run("kubelet", filepath.Join(bin, "kubelet"), "--config="+c.path("kubelet.yaml"),
		"--kubeconfig="+c.Kubeconfig, "--root-dir="+c.path("kubelet"), "--cert-dir="+c.path("kubelet-certs"),
		"--node-ip="+c.NodeIP, "--hostname-override="+c.Node, "--v=1"); err != nil {
		return c, err
	}
	if err := c.startKubeProxy(ctx, bin); err != nil {
		return c, err
	}
	// The scheduler, and the controller manager: the default service account, the node lifecycle
	// (the not-ready taint), the claims' binding and their hostpath provisioner, garbage collection.
	if err := c.run("kube-scheduler", filepath.Join(bin, "kube-scheduler"), "--kubeconfig="+c.Kubeconfig,
		"--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--leader-elect=false", "--secure-port=0"); err != nil {
		return c, err
	}
	if err := c.run("kube-controller-manager", filepath.Join(bin, "kube-controller-manager"),
		"--kubeconfig="+c.Kubeconfig, "--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--leader-elect=false", "--secure-port=0", "--use-service-account-credentials=false",
		"--service-account-private-key-file="+c.path("sa.key"), "--root-ca-file="+c.path("certs/apiserver.crt"),
		"--enable-hostpath-provisioner=true", "--controllers=*,-bootstrapsigner,-tokencleaner",
		"--node-monitor-grace-period=40s"); err != nil {
		return c, err
	}
	if err := c.until(ctx, "node "+c.Node+" Ready and untainted", 120*time.Second, func() (bool, error) {
		n, err := c.Client.CoreV1().Nodes().Get(ctx, c.Node, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, t := range n.Spec.Taints {
			if t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute {
				return false, nil
			}
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	}); err != nil {
		return c, err
	}
	if err := c.until(ctx, "the default service account", 60*time.Second, func() (bool, error) {
		_, err := c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	}); err != nil {
		return c, err
	}
	del := corev1.PersistentVolumeReclaimDelete
	_, err = c.Client.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta:    metav1.ObjectMeta{Name: StorageClass},
		Provisioner:   "kubernetes.io/host-path",
		ReclaimPolicy: &del,
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return c, err
	}
	return c, nil
}

func (c *Cluster) path(p string) string { return filepath.Join(c.Dir, p) }

// run starts one of the cluster's processes, its output in logs/NAME.log.
func (c *Cluster) run(name, bin string, args ...string) error {
	logPath := c.path("logs/" + name + ".log")
	f, err := os.Create(logPath)
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("kubetest: start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		cmd.Wait()
		f.Close()
		close(p.done)
	}()
	c.procs = append(c.procs, p)
	return nil
}

// Log is the tail of one process's log (for a failing test's message).
func (c *Cluster) Log(name string, n int) string {
	b, _ := os.ReadFile(c.path("logs/" + name + ".log"))
	return tail(b, n)
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// until polls cond every 100 ms until it holds, a process of the cluster died, or d passed.
func (c *Cluster) until(ctx context.Context, what string, d time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(d)
	for {
		ok, err := cond()
		if err != nil {
			return fmt.Errorf("kubetest: waiting for %s: %w", what, err)
		}
		if ok {
			return nil
		}
		for _, p := range c.procs {
			select {
			case <-p.done:
				return fmt.Errorf("kubetest: %s exited while waiting for %s: %s", p.name, what, c.Log(p.name, 3000))
			default:
			}
		}
		if time.Now().After(deadline) {
			var logs []string
			for _, p := range c.procs {
				logs = append(logs, p.name+": "+c.Log(p.name, 1500))
			}
			return fmt.Errorf("kubetest: %s not there after %s; logs:\n%s", what, d, strings.Join(logs, "\n"))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Cluster) waitPort(what string, port int, d time.Duration) error {
	return c.until(context.Background(), what, d, func() (bool, error) {
		conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			conn.Close()
		}
		return err == nil, nil
	})
}

func freePorts(n int) ([]int, error) {
	var ports []int
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// nodeIP is the machine's first non-loopback IPv4 address (kubelet refuses a loopback node IP).
func nodeIP() (string, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return "", err
	}
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 || strings.HasPrefix(i.Name, bridgeName) || strings.HasPrefix(i.Name, "veth") {
			continue
		}
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
				return n.IP.String(), nil
			}
		}
	}
	return "", errors.New("kubetest: no non-loopback IPv4 address for the node (kubelet needs one)")
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func writeSAKeys(keyFile, pubFile string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600); err != nil {
		return err
	}
	return os.WriteFile(pubFile, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644)
}

func kubeconfig(server, token string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: sbxkube
  cluster:
    server: %s
    insecure-skip-tls-verify: true
users:
- name: admin
  user:
    token: %s
contexts:
- name: sbxkube
  context: {cluster: sbxkube, user: admin, namespace: default}
current-context: sbxkube
`, server, token)
}

func (c *Cluster) writeContainerdConfig(streamPort int) error {
	cni := c.path("cni")
	if err := os.MkdirAll(cni, 0o755); err != nil {
		return err
	}
	conflist := fmt.Sprintf(`{"cniVersion": "0.4.0", "name": "sbxkube", "plugins": [
  {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}`, bridgeName, PodCIDR, c.path("cni-ipam"))
	if err := os.WriteFile(filepath.Join(cni, "10-sbxkube.conflist"), []byte(conflist), 0o644); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[ttrpc]
  address = %q
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "%d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
`, c.path("containerd/root"), c.path("containerd/state"), c.containerd, c.containerd+".ttrpc", PauseImage, streamPort, cni)
	return os.WriteFile(c.path("containerd.toml"), []byte(cfg), 0o644)
}

func (c *Cluster) writeKubeletConfig(port int) error {
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
containerRuntimeEndpoint: unix://%s
address: %s
port: %d
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %q}
authorization: {mode: AlwaysAllow}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "1Mi", "nodefs.available": "1%%", "imagefs.available": "1%%"}
serializeImagePulls: false
syncFrequency: 10s
nodeStatusUpdateFrequency: 5s
`, c.containerd, c.NodeIP, port, c.path("kubelet-client-ca.crt"))
	return os.WriteFile(c.path("kubelet.yaml"), []byte(cfg), 0o644)
}

// Ctr runs ctr against the cluster's containerd in the k8s.io namespace.
func (c *Cluster) Ctr(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "ctr", append([]string{"--address", c.containerd, "-n", "k8s.io"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

// importImages builds the pause and sandbox images and imports them.
func (c *Cluster) importImages(ctx context.Context) error {
	pause, err := c.BuildStatic(ctx, "./sandbox/provider/kube/kubetest/pause")
	if err != nil {
		return err
	}
	agent, err := c.BuildStatic(ctx, "./cmd/sbx-agent")
	if err != nil {
		return err
	}
	pauseIm := NewImage(PauseImage, "/pause")
	pauseIm.AddFile("/pause", pause, 0o755)
	sbx, err := SandboxImageSpec(agent)
	if err != nil {
		return err
	}
	for _, im := range []*Image{pauseIm, sbx} {
		if err := c.Import(ctx, im); err != nil {
			return err
		}
	}
	return nil
}

// BuildStatic builds the repository's package pkg (./cmd/NAME) with CGO_ENABLED=0 into the
// cluster's state directory and returns the binary's path.
func (c *Cluster) BuildStatic(ctx context.Context, pkg string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	out := filepath.Join(c.path("build"), filepath.Base(pkg))
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("kubetest: build %s: %v: %s", pkg, err, b)
	}
	return out, nil
}

// Import writes im as a docker-archive tar and imports it into the cluster's containerd, where
// pods with imagePullPolicy Never find it.
func (c *Cluster) Import(ctx context.Context, im *Image) error {
	if err := os.MkdirAll(c.path("build"), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(c.path("build"), "image-*.tar")
	if err != nil {
		return err
	}
	f.Close()
	defer os.Remove(f.Name())
	if err := im.WriteArchiveFile(f.Name()); err != nil {
		return err
	}
	_, err = c.Ctr(ctx, "images", "import", "--no-unpack=false", f.Name())
	return err
}

// BrokerImageSpec is the broker's image: the static broker binary (cmd/broker builds with
// CGO_ENABLED=0) at /usr/local/bin/broker, its entrypoint, and an empty /tmp; no shell, no other
// file. deploy/kubernetes runs it as a non-root user with a read-only root filesystem.
func BrokerImageSpec(broker string) *Image {
	im := NewImage(BrokerImage, "/usr/local/bin/broker")
	im.Env = []string{"PATH=/usr/local/bin"}
	im.AddFile("/usr/local/bin/broker", broker, 0o755)
	im.AddDir("/tmp", 0o1777)
	return im
}

// SandboxImageSpec is the sandbox image: sbx-agent at /sbx/sbx-agent (its entrypoint), busybox's
// static userland in /bin, /workspace, /tmp, an /etc/passwd.
func SandboxImageSpec(sbxAgent string) (*Image, error) {
	busybox := "/bin/busybox"
	if _, err := os.Stat(busybox); err != nil {
		return nil, fmt.Errorf("kubetest: %s missing: run scripts/deps.sh (Debian busybox-static)", busybox)
	}
	out, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		return nil, fmt.Errorf("kubetest: busybox --list: %w", err)
	}
	im := NewImage(SandboxImage, "/sbx/sbx-agent")
	im.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
	im.AddFile("/sbx/sbx-agent", sbxAgent, 0o755)
	im.AddFile("/bin/busybox", busybox, 0o755)
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if name := strings.TrimSpace(sc.Text()); name != "" && name != "busybox" && !strings.Contains(name, "/") {
			im.AddLink("/bin/"+name, "busybox")
		}
	}
	im.AddDir("/workspace", 0o755)
	im.AddDir("/tmp", 0o1777)
	im.AddDir("/root", 0o700)
	im.AddData("/etc/passwd", []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"), 0o644)
	im.AddData("/etc/group", []byte("root:x:0:\nnogroup:x:65534:\n"), 0o644)
	return im, nil
}
