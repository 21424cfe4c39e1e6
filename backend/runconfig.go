package backend

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/sbxbroker/broker/protocol"
)

// ErrNoSandbox means the run config has no sandbox block and the caller does not allow local mode.
var ErrNoSandbox = protocol.Errorf(protocol.CodeInvalidArgument, "the run config has no sandbox block (configurable.sandbox); send one with every run (sbctl run-config)")

// RunConfigOptions say what to do without a sandbox block.
type RunConfigOptions struct {
	// LocalRoot, when set, makes a run without a sandbox block use Local(LocalRoot) (CLI mode).
	// Empty means such a run is an error.
	LocalRoot string
	// Dial tunes the dataplane connection (URL, credential and sandbox id come from the block).
	Dial Config
}

// FromRunConfig returns the backend a run's configurable names: the sandbox of its "sandbox" block
// through the dataplane, or Local when there is no block and opts allow it. A malformed block is a
// clear error naming the key. configurable is the run's config.configurable, as decoded JSON
// (map[string]any) or raw JSON ([]byte, json.RawMessage).
//
// Credentials in a block are short-lived: agent servers keep a run's configurable in thread state,
// and a later run without config inherits it, so clients should send a fresh block with every run.
func FromRunConfig(ctx context.Context, configurable any, opts RunConfigOptions) (Backend, error) {
	block, present, err := SandboxBlockOf(configurable)
	if err != nil {
		return nil, err
	}
	if !present {
		if opts.LocalRoot == "" {
			return nil, ErrNoSandbox
		}
		return Local(opts.LocalRoot)
	}
	cfg := opts.Dial
	cfg.URL, cfg.Credential, cfg.SandboxID = block.DataplaneURL, block.Credential, block.SandboxID
	return Dial(ctx, cfg)
}

// SandboxBlockOf extracts and checks the sandbox block of a configurable. Extra keys are ignored;
// missing or mistyped ones are an error that names them.
func SandboxBlockOf(configurable any) (protocol.SandboxBlock, bool, error) {
	var raw []byte
	switch v := configurable.(type) {
	case nil:
		return protocol.SandboxBlock{}, false, nil
	case []byte:
		raw = v
	case json.RawMessage:
		raw = v
	default:
		var err error
		if raw, err = json.Marshal(v); err != nil {
			return protocol.SandboxBlock{}, false, bad("configurable is not JSON: %v", err)
		}
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(raw, &top); err != nil {
		return protocol.SandboxBlock{}, false, bad("configurable must be a JSON object")
	}
	sb, ok := top["sandbox"]
	if !ok || string(sb) == "null" {
		return protocol.SandboxBlock{}, false, nil
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(sb, &fields); err != nil {
		return protocol.SandboxBlock{}, true, bad("configurable.sandbox must be an object with sandbox_id, credential and dataplane_url")
	}
	var b protocol.SandboxBlock
	for _, f := range []struct {
		key string
		dst *string
	}{{"sandbox_id", &b.SandboxID}, {"credential", &b.Credential}, {"dataplane_url", &b.DataplaneURL}} {
		v, ok := fields[f.key]
		if !ok {
			return b, true, bad("configurable.sandbox.%s is missing", f.key)
		}
		if err := json.Unmarshal(v, f.dst); err != nil || *f.dst == "" {
			return b, true, bad("configurable.sandbox.%s must be a non-empty string", f.key)
		}
	}
	// mcp_url is optional: blocks from brokers before it, and other writers, lack it.
	if v, ok := fields["mcp_url"]; ok {
		json.Unmarshal(v, &b.MCPURL)
	}
	return b, true, nil
}

func bad(format string, args ...any) error {
	return &protocol.Error{Code: protocol.CodeInvalidArgument, Message: "malformed run config: " + fmt.Sprintf(format, args...)}
}
