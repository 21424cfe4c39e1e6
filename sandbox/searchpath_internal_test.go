package sandbox

import (
	"testing"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// localProvider stands for a provider whose sandboxes run here (namespace, gvisor, dir), and
// remoteProvider for the kubernetes provider, whose sandboxes run in an image the broker does not
// look into. Only which of the two matters to SearchPath.
type localProvider struct{ provider.Provider }

type remoteProvider struct{ provider.Provider }

func (remoteProvider) RemoteWorkspace() {}

// A local provider's sandboxes find programs through the PATH the broker gives them (the
// template's or the base one); a remote one's, through the template's PATH if it sets one, else
// through its image's, which the broker does not know: the delegation policy must then not guess.
func TestSearchPathIsUnknownForARemoteTemplateWithoutPATH(t *testing.T) {
	templates := map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"venv":    {Name: "venv", Env: map[string]string{"PATH": "/workspace/.venv/bin:/usr/bin"}},
	}
	local := &Manager{cfg: Config{Provider: localProvider{}, Templates: templates}}
	remote := &Manager{cfg: Config{Provider: remoteProvider{}, Templates: templates}}
	for _, tc := range []struct {
		m        *Manager
		template string
		path     string
		known    bool
	}{
		{local, "default", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", true},
		{local, "venv", "/workspace/.venv/bin:/usr/bin", true},
		{remote, "venv", "/workspace/.venv/bin:/usr/bin", true},
		{remote, "default", "", false},
		{remote, "gone", "", false}, // a template no longer configured is read as the default
	} {
		path, known := tc.m.SearchPath(store.Record{Template: tc.template})
		if path != tc.path || known != tc.known {
			t.Errorf("remote %v, template %s: SearchPath = %q, %v; want %q, %v",
				provider.IsRemote(tc.m.cfg.Provider), tc.template, path, known, tc.path, tc.known)
		}
	}
}
