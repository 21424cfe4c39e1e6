package workspace

import (
	"context"

	"github.com/sbxbroker/broker/baseline"
	"github.com/sbxbroker/broker/protocol"
)

// Changes compares the tree at a.Path (default the workspace) with the baseline a push recorded in
// it (protocol.BaselineRecord) and lists what differs, by git blob id: see baseline.Changes. It
// reads through an os.Root opened on the tree, never follows a symlink, and is bounded by the
// workspace's MaxScanEntries.
func (w *Workspace) Changes(ctx context.Context, a protocol.ChangesArgs) (protocol.ChangesResult, error) {
	p := a.Path
	if p == "" {
		p = Root
	}
	rel, sp, err := resolve(p)
	if err != nil {
		return protocol.ChangesResult{}, err
	}
	sub, err := w.openTree(rel, sp)
	if err != nil {
		return protocol.ChangesResult{}, err
	}
	defer sub.Close()
	res, err := baseline.Changes(ctx, sub, baseline.Options{MaxEntries: w.opts.MaxScanEntries, Only: a.Paths})
	res.Path = sp
	if err != nil {
		return res, fsErr(sp, err)
	}
	return res, nil
}
