package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
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
	// DiskQuota says whether each sandbox's workspace is a filesystem of its own size (volume.go);
	// DiskQuotaReason says why not.
	DiskQuota       bool   `json:"disk_quota"`
	DiskQuotaReason string `json:"disk_quota_reason,omitempty"`
	// Cgroups is the cgroup version limits use: "v1", "v2", or "" for none.
	Cgroups string `json:"cgroups,omitempty"`
	// Fallback is why "auto" chose dir: the host cannot run namespace sandboxes. Empty when it did
	// not fall back.
	Fallback string `json:"fallback,omitempty"`
	// Took is how long the preflight ran.
	Took time.Duration `json:"took"`
}

// dirWarning says what the dir provider does not do, and whom commands run as.
func dirWarning(cfg Config) string {
	who := "the broker's user"
	if os.Geteuid() == 0 {
		uid := cfg.UID
		if uid == 0 {
			uid = DefaultUID
		}
		who = fmt.Sprintf("uid %d", uid)
	}
	return "dir provider: sandboxes are plain directories on the host; commands run as " + who +
		" with no isolation (they see the host's files, processes and network) and no resource limits"
}

// Preflight picks a provider for this host by actually trying it: for the namespace provider it
// finds bwrap, starts a throwaway sandbox under DataDir, runs `true` through its init, and checks
// cgroups. choice is "auto", "namespace" (an error that says how to fix it if it cannot work) or
// "dir" (always, with a warning that there is no isolation).
//
// "auto" falls back to dir only when the host cannot run namespace sandboxes at all (no bwrap, user
// namespaces disabled or blocked: ErrNoNamespaces), never because something ran out: a resource
// error (a full disk, a file, process or user-namespace limit reached) is returned as a
// *ResourceError that says how to free the resource, and any other failure is returned as is.
// Falling back on those would hand tenants the host for a problem the operator can fix.
func Preflight(ctx context.Context, cfg Config, choice string) (Provider, Report, error) {
	start := time.Now()
	switch choice {
	case ChoiceDir:
		d, err := NewDir(cfg)
		if err != nil {
			return nil, Report{}, err
		}
		return d, dirReport(cfg, "", start), nil
	case ChoiceAuto, ChoiceNamespace, "":
	default:
		return nil, Report{}, fmt.Errorf("unknown provider %q: use auto, namespace or dir", choice)
	}
	n, err := newNamespaceChecked(cfg)
	if err == nil {
		err = probeNamespace(ctx, n)
	}
	if err == nil {
		r := Report{Provider: kindNamespace, Cgroups: n.cg.version, Took: time.Since(start)}
		r.LimitsEnforced, r.LimitsReason = n.LimitsEnforced()
		if !r.LimitsEnforced {
			r.Warning = "namespace provider: resource limits are not enforced: " + r.LimitsReason
		}
		r.DiskQuota, r.DiskQuotaReason = n.DiskQuotaEnforced()
		if !r.DiskQuota {
			if r.Warning == "" {
				r.Warning = "namespace provider"
			}
			r.Warning += ": disk quotas are not enforced: " + r.DiskQuotaReason
		}
		return n, r, nil
	}
	err = classify(err, cfg)
	failed := Report{Provider: kindNamespace, Took: time.Since(start)}
	var re *ResourceError
	switch {
	case errors.As(err, &re):
		return nil, failed, fmt.Errorf("namespace provider: %w", err)
	case choice == ChoiceNamespace || !errors.Is(err, ErrNoNamespaces):
		msg := strings.TrimPrefix(err.Error(), ErrUnavailable.Error()+": ")
		if choice != ChoiceNamespace {
			msg += " (not falling back to the dir provider, which would run sandboxes with no isolation: nothing says this host cannot run namespace sandboxes)"
		}
		return nil, failed, fmt.Errorf("%w: namespace provider: %s", ErrUnavailable, msg)
	}
	d, derr := NewDir(cfg)
	if derr != nil {
		return nil, Report{}, derr
	}
	why := err.Error()
	r := dirReport(cfg, "namespace provider unavailable, falling back to dir: "+why, start)
	r.Fallback = why
	return d, r, nil
}

// newNamespaceChecked is NewNamespace, with a missing bwrap reported as ErrNoNamespaces: the one
// check of NewNamespace that says the host cannot run namespace sandboxes at all.
func newNamespaceChecked(cfg Config) (*Namespace, error) {
	bwrap := cfg.BwrapPath
	if bwrap == "" {
		bwrap = "bwrap"
	}
	if _, err := exec.LookPath(bwrap); err != nil {
		return nil, fmt.Errorf("%w: bwrap not found (%s): install bubblewrap: apt-get install -y bubblewrap", ErrNoNamespaces, bwrap)
	}
	return NewNamespace(cfg)
}

func dirReport(cfg Config, prefix string, start time.Time) Report {
	w := dirWarning(cfg)
	if prefix != "" {
		w = prefix + "; " + w
	}
	return Report{
		Provider:        kindDir,
		Warning:         w,
		LimitsReason:    "the dir provider enforces no limits (exec timeouts only)",
		DiskQuotaReason: "the dir provider has no disk quota",
		Took:            time.Since(start),
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
	probe.vol.enabled, probe.vol.reason, probe.vol.mkfs, probe.vol.reserve, probe.vol.log, probe.vol.imagesDir =
		n.vol.enabled, n.vol.reason, n.vol.mkfs, n.vol.reserve, n.vol.log, n.vol.imagesDir
	if err := probe.prepareDataDir(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	// A small disk: its base image is made once for the data dir (the probe shares the provider's
	// disk-images), and mounting and unmounting it is cheaper than the default size's.
	tmpl := DefaultTemplate()
	tmpl.Disk = 2 * MinDisk
	spec := Spec{ID: NewID(), Template: tmpl}
	if err := probe.Create(ctx, spec); err != nil {
		var re *ResourceError
		if !probe.vol.enabled || errors.As(err, &re) {
			return err
		}
		// The host cannot make or mount a filesystem image: sandboxes run without disk quotas
		// (reported), not without isolation.
		_ = probe.Destroy(context.Background(), spec)
		n.vol.enabled, n.vol.reason = false, "a test sandbox's disk image could not be made or mounted: "+err.Error()
		probe.vol.enabled = false
		if err := probe.Create(ctx, spec); err != nil {
			return err
		}
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
