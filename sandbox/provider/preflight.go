package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// Provider choices for Preflight.
const (
	ChoiceAuto      = "auto"
	ChoiceNamespace = "namespace"
	ChoiceDir       = "dir"
)

// Report is what Preflight found, for the broker's startup log and its health endpoint.
type Report struct {
	// Provider is the chosen provider's name.
	Provider string `json:"provider"`
	// Warning is the one thing an operator must read, empty when there is none: why the namespace
	// provider cannot run here and how to fix it, that the dir provider isolates nothing, or that
	// limits are not enforced.
	Warning string `json:"warning,omitempty"`
	// LimitsEnforced says whether memory, pids and cpu limits apply to sandboxes; LimitsReason says
	// why not.
	LimitsEnforced bool   `json:"limits_enforced"`
	LimitsReason   string `json:"limits_reason,omitempty"`
	// Cgroups is the cgroup version limits use: "v1", "v2", or "" for none.
	Cgroups string `json:"cgroups,omitempty"`
	// Took is how long the preflight ran.
	Took time.Duration `json:"took"`
}

const dirWarning = "dir provider: sandboxes are plain directories on the host; commands run as the broker's user with no isolation and no resource limits"

// Preflight picks a provider for this host by actually trying it: for the namespace provider it
// finds bwrap, starts a throwaway sandbox under DataDir, runs `true` through its init, and checks
// cgroups. choice is "auto" (namespace if that works, else dir with a warning saying why and how to
// fix it), "namespace" (an error with that guidance if it cannot work) or "dir" (always, with a
// warning that there is no isolation).
func Preflight(ctx context.Context, cfg Config, choice string) (Provider, Report, error) {
	start := time.Now()
	switch choice {
	case ChoiceDir:
		d, err := NewDir(cfg)
		if err != nil {
			return nil, Report{}, err
		}
		return d, dirReport("", start), nil
	case ChoiceAuto, ChoiceNamespace, "":
	default:
		return nil, Report{}, fmt.Errorf("unknown provider %q: use auto, namespace or dir", choice)
	}
	n, err := NewNamespace(cfg)
	if err == nil {
		err = probeNamespace(ctx, n)
	}
	if err == nil {
		r := Report{Provider: kindNamespace, Cgroups: n.cg.version, Took: time.Since(start)}
		r.LimitsEnforced, r.LimitsReason = n.LimitsEnforced()
		if !r.LimitsEnforced {
			r.Warning = "namespace provider: resource limits are not enforced: " + r.LimitsReason
		}
		return n, r, nil
	}
	why := namespaceGuidance(err)
	if choice == ChoiceNamespace {
		return nil, Report{Provider: kindNamespace, Took: time.Since(start)}, fmt.Errorf("%w: namespace provider: %s", ErrUnavailable, why)
	}
	d, derr := NewDir(cfg)
	if derr != nil {
		return nil, Report{}, derr
	}
	return d, dirReport("namespace provider unavailable, falling back to dir: "+why, start), nil
}

func dirReport(prefix string, start time.Time) Report {
	w := dirWarning
	if prefix != "" {
		w = prefix + "; " + dirWarning
	}
	return Report{
		Provider:     kindDir,
		Warning:      w,
		LimitsReason: "the dir provider enforces no limits (exec timeouts only)",
		Took:         time.Since(start),
	}
}

// probeNamespace runs one real sandbox in a throwaway data dir: the cheapest proof that bwrap, user
// namespaces, the init and the cgroups all work together here.
func probeNamespace(ctx context.Context, n *Namespace) error {
	dir, err := os.MkdirTemp(n.cfg.DataDir, "preflight-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o711); err != nil {
		return err
	}
	cfg := n.cfg
	cfg.DataDir = dir
	probe := &Namespace{
		cfg:        cfg,
		layout:     layout{dataDir: dir},
		bwrap:      n.bwrap,
		asRoot:     n.asRoot,
		cg:         n.cg,
		hostRoot:   n.hostRoot,
		hostShell:  n.hostShell,
		initInterp: n.initInterp,
	}
	if err := probe.prepareDataDir(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	spec := Spec{ID: NewID(), Template: DefaultTemplate()}
	if err := probe.Create(ctx, spec); err != nil {
		return err
	}
	defer probe.Destroy(context.Background(), spec)
	in, err := probe.Start(ctx, spec)
	if err != nil {
		return err
	}
	defer in.Stop(context.Background())
	res, err := in.Exec(ctx, ExecRequest{Argv: []string{"true"}})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("`true` in a test sandbox exited %d", res.ExitCode)
	}
	return in.Stop(ctx)
}

// namespaceGuidance is err plus what to do about it, as precisely as the host lets us tell.
func namespaceGuidance(err error) string {
	msg := err.Error()
	if errors.Is(err, ErrUnavailable) {
		msg = strings.TrimPrefix(msg, ErrUnavailable.Error()+": ")
	}
	if hint := usernsHint(); hint != "" {
		return msg + "; " + hint
	}
	low := strings.ToLower(msg)
	for _, s := range []string{"namespace", "uid map", "uid_map", "operation not permitted", "setting up"} {
		if strings.Contains(low, s) {
			return msg + "; unprivileged user namespaces seem blocked here (a container's seccomp or AppArmor profile?): allow them, or run with --provider dir"
		}
	}
	return msg
}

// usernsHint names the sysctl that disables unprivileged user namespaces on this host, if any.
func usernsHint() string {
	read := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(b))
	}
	switch {
	case read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
		return "user namespaces are disabled: sysctl -w kernel.unprivileged_userns_clone=1"
	case read("/proc/sys/user/max_user_namespaces") == "0":
		return "user namespaces are disabled: sysctl -w user.max_user_namespaces=15000"
	case read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
		return "AppArmor restricts unprivileged user namespaces: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or give bwrap an AppArmor profile that allows userns"
	}
	return ""
}
