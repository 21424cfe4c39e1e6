package backend

import (
	"context"

	"github.com/sbxbroker/broker/protocol"
)

// Changes lists what differs in the tree a.Path (default /workspace) from the baseline its last
// push recorded (sbctl push): added, modified and deleted files and symlinks with their git blob
// ids, computed by the broker where the files are. It needs the fs:read scope only. A tree never
// pushed to is a file_not_found error.
func (r *Remote) Changes(ctx context.Context, a protocol.ChangesArgs) (protocol.ChangesResult, error) {
	var out protocol.ChangesResult
	if err := validPaths(a.Path); err != nil {
		return out, err
	}
	return out, r.call(ctx, protocol.OpChanges, a, &out, true)
}
