package backend

import "github.com/sbxbroker/broker/protocol"

// Local is not available on Windows: it runs commands in process groups and opens files through
// the workspace package's openat-based resolution, which are Unix facilities. Remote (Dial) works
// everywhere, so sbctl and the SDK build for Windows.
func Local(root string) (Backend, error) {
	return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the local backend runs on Linux and macOS only; on Windows use a sandbox on a broker (a run-config block with a dataplane_url)")
}
