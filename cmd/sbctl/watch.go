package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	tea "github.com/charmbracelet/bubbletea"
	"github.com/charmbracelet/lipgloss"
	"github.com/mattn/go-runewidth"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
)

// sbctl watch is a full-screen pane over the org's sandboxes and their events (Bubble Tea does the
// terminal). Everything it shows that came from the broker (names, tags, event fields, errors) goes
// through termSafe first: sandboxes and delegates are untrusted, and the pane must never pass one
// of their escape sequences to the terminal.

const (
	watchRefresh   = 3 * time.Second // the sandbox list is re-read this often (and on lifecycle events)
	watchEventKeep = 500             // events kept for the pane
)

func watchCmd(g *globals) *cobra.Command {
	var tags []string
	var backlog int
	cmd := outputs(&cobra.Command{
		Use:   "watch [REF]",
		Short: "A live full-screen view of the org's sandboxes and their events",
		Long: `Show the org's sandboxes (name, status, isolation, the broker hosting it, the lease counting down,
tags) above a live pane of events, for the selected sandbox or the whole org. The events come over
SSE and resume where they left off after a dropped connection. With REF the view starts on that
sandbox.

Keys: up/down (or k/j) select, s stop, r resume, e extend the lease, d delete (asks first),
x open a shell in the selected sandbox (as sbctl shell; exit or Ctrl-D comes back here),
/ filter by tag (key=value; empty clears), a events of the selected sandbox or of all, q quit.
A lease about to run out is marked with "!".

When stdout is not a terminal it prints the sandbox list once, then one line per event.`,
		Example: "  sbctl watch\n  sbctl watch dev\n  sbctl watch --tag team=infra\n  sbctl watch > events.log",
		Args:    maxArgs(1, "at most one REF"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			sel, err := parseTags(tags)
			if err != nil {
				return err
			}
			ref := ""
			if len(args) == 1 {
				ref = args[0]
			}
			f, ok := g.stdout.(*os.File)
			if !ok || !term.IsTerminal(int(f.Fd())) {
				return watchPlain(cmd.Context(), g, c, ref, sel, backlog)
			}
			return watchTUI(cmd.Context(), g, c, ref, sel, backlog)
		},
	}, "it is a live view (-o json streams are sbctl events --all -f -o json)", "table")
	cmd.Flags().StringArrayVar(&tags, "tag", nil, "only sandboxes with tag key=value (repeatable: all must match)")
	cmd.Flags().IntVar(&backlog, "backlog", 50, "start the events pane with this many recent events")
	return cmd
}

// watchPlain is watch without a terminal: the list once, then event lines as they come.
func watchPlain(ctx context.Context, g *globals, c *client.Client, ref string, sel map[string]string, backlog int) error {
	all, err := c.ListAllSandboxes(ctx, client.ListOptions{Tags: sel})
	if err != nil {
		return err
	}
	if ref != "" {
		s, err := c.GetSandbox(ctx, ref)
		if err != nil {
			return err
		}
		all = []protocol.Sandbox{s}
	}
	safeTable(g.stdout, func(w io.Writer) { sandboxTable(w, all) })
	tw := tabwriter.NewWriter(termWriter{g.stdout}, 0, 4, 1, ' ', 0)
	o := client.EventOptions{Ref: ref, Follow: true, Backlog: backlog}
	o.OnReconnect = func(err error, attempt int) {
		if attempt == 1 || attempt%10 == 0 {
			fmt.Fprintf(g.stderr, "sbctl: event stream dropped (%s); reconnecting\n", termSafe(err.Error()))
		}
	}
	err = c.Events(ctx, o, func(e protocol.Event) error {
		if ref == "" && len(sel) > 0 && !matchesAny(all, e.SandboxID) && e.Type != protocol.EventCreated {
			return nil
		}
		fmt.Fprintln(tw, eventLine(e, ref == ""))
		return tw.Flush()
	})
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

func matchesAny(all []protocol.Sandbox, id string) bool {
	for _, s := range all {
		if s.ID == id {
			return true
		}
	}
	return false
}

// Messages into the model.
type (
	sandboxesMsg struct {
		items []protocol.Sandbox
		nodes map[string]string // sandbox id -> its broker, for ids not known before
		err   error
	}
	eventMsg     protocol.Event
	streamMsg    struct{ err error } // the event stream dropped (and is being reopened)
	streamEndMsg struct{ err error } // the event stream ended for good
	tickMsg      time.Time
	actionMsg    struct {
		what string // "stopped dev"
		err  error
	}
)

// prompt is what the footer asks for, if anything.
type prompt int

const (
	promptNone prompt = iota
	promptDelete
	promptExtend
	promptFilter
)

type watchModel struct {
	ctx       context.Context
	c         *client.Client
	broker    string
	sandboxes []protocol.Sandbox
	loaded    bool
	selected  string // the selected sandbox's id
	offset    int    // first sandbox row shown
	allEvents bool   // the events pane shows the whole org, not the selected sandbox
	events    []protocol.Event
	expiring  map[string]time.Time // sandbox id -> when an expiring event said it would stop
	nodes     map[string]string    // sandbox id -> the broker hosting it (a list does not say)
	filter    map[string]string
	width     int
	height    int
	prompt    prompt
	input     []rune
	status    string // one line of news: an action's result, an error, the stream's state
	statusErr bool
	now       func() time.Time
}

func newWatchModel(ctx context.Context, c *client.Client, broker, ref string, filter map[string]string) *watchModel {
	return &watchModel{ctx: ctx, c: c, broker: broker, selected: ref, allEvents: ref == "", filter: filter,
		expiring: map[string]time.Time{}, nodes: map[string]string{}, width: 80, height: 24, now: time.Now}
}

func watchTUI(ctx context.Context, g *globals, c *client.Client, ref string, sel map[string]string, backlog int) error {
	// A broker that is not there or a key it refuses is an error on the command line (exit 6, 4),
	// not a full screen that only says so.
	if _, err := c.ListSandboxes(ctx, client.ListOptions{Limit: 1}); err != nil {
		return err
	}
	if ref != "" {
		s, err := c.GetSandbox(ctx, ref)
		if err != nil {
			return err
		}
		ref = s.ID
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	m := newWatchModel(ctx, c, c.BaseURL(), ref, sel)
	p := tea.NewProgram(m, tea.WithAltScreen(), tea.WithContext(ctx), tea.WithInput(g.stdin), tea.WithOutput(g.stdout))
	go func() {
		o := client.EventOptions{Follow: true, Backlog: backlog}
		o.OnReconnect = func(err error, _ int) { p.Send(streamMsg{err}) }
		err := c.Events(ctx, o, func(e protocol.Event) error {
			p.Send(eventMsg(e))
			return nil
		})
		if ctx.Err() == nil {
			p.Send(streamEndMsg{err})
		}
	}()
	_, err := p.Run()
	if errors.Is(err, tea.ErrProgramKilled) && ctx.Err() != nil {
		return nil // Ctrl-C or SIGTERM through the context: a clean end
	}
	return err
}

func (m *watchModel) Init() tea.Cmd { return tea.Batch(m.refresh(), tick()) }

func tick() tea.Cmd {
	return tea.Tick(time.Second, func(t time.Time) tea.Msg { return tickMsg(t) })
}

func (m *watchModel) refresh() tea.Cmd {
	filter := m.filter
	known := make(map[string]bool, len(m.nodes))
	for id := range m.nodes {
		known[id] = true
	}
	return func() tea.Msg {
		ctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
		defer cancel()
		items, err := m.c.ListAllSandboxes(ctx, client.ListOptions{Tags: filter})
		if err != nil {
			return sandboxesMsg{err: err}
		}
		// A sandbox's broker is in its dataplane URL, which only a get answers: one get per
		// sandbox the pane has not seen yet (a few per refresh, so a large org fills in over time).
		nodes := map[string]string{}
		for _, s := range items {
			if known[s.ID] || len(nodes) >= 20 {
				continue
			}
			if full, err := m.c.GetSandbox(ctx, s.ID); err == nil {
				nodes[s.ID] = nodeOf(full)
			}
		}
		return sandboxesMsg{items: items, nodes: nodes}
	}
}

// act runs one lifecycle call on the selected sandbox.
func (m *watchModel) act(verb string, call func(ctx context.Context, id string) error) tea.Cmd {
	s, ok := m.current()
	if !ok {
		return nil
	}
	m.setStatus(false, "%s %s...", strings.TrimSuffix(verb, "ed")+"ing", termSafe(s.Name))
	id, name := s.ID, s.Name
	return func() tea.Msg {
		ctx, cancel := context.WithTimeout(m.ctx, time.Minute)
		defer cancel()
		return actionMsg{verb + " " + name, call(ctx, id)}
	}
}

func (m *watchModel) setStatus(isErr bool, format string, args ...any) {
	m.status, m.statusErr = fmt.Sprintf(format, args...), isErr
}

func (m *watchModel) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
	case tickMsg:
		cmds := []tea.Cmd{tick()}
		if time.Time(msg).Unix()%int64(watchRefresh/time.Second) == 0 {
			cmds = append(cmds, m.refresh())
		}
		return m, tea.Batch(cmds...)
	case sandboxesMsg:
		if msg.err != nil {
			m.setStatus(true, "cannot list sandboxes: %s", termSafe(describe(msg.err)))
			return m, nil
		}
		if m.status != "" && strings.HasPrefix(m.status, "cannot list") {
			m.status = ""
		}
		m.loaded = true
		m.sandboxes = msg.items
		for id, n := range msg.nodes {
			m.nodes[id] = n
		}
		sort.Slice(m.sandboxes, func(i, j int) bool { return m.sandboxes[i].Name < m.sandboxes[j].Name })
		if _, ok := m.current(); !ok && len(m.sandboxes) > 0 {
			m.selected = m.sandboxes[0].ID
		}
	case eventMsg:
		e := protocol.Event(msg)
		m.events = append(m.events, e)
		if len(m.events) > watchEventKeep {
			m.events = m.events[len(m.events)-watchEventKeep:]
		}
		if strings.HasPrefix(m.status, "event stream dropped") {
			m.status = ""
		}
		switch e.Type {
		case protocol.EventExpiring:
			if e.SecondsLeft != nil {
				m.expiring[e.SandboxID] = e.Time.Add(time.Duration(*e.SecondsLeft) * time.Second)
			}
			return m, m.refresh()
		case protocol.EventCreated, protocol.EventReused, protocol.EventResumed, protocol.EventStopped,
			protocol.EventFailed, protocol.EventDeleted, protocol.EventNodeLost, protocol.EventNodeReturned:
			delete(m.expiring, e.SandboxID)
			return m, m.refresh()
		}
	case streamMsg:
		m.setStatus(true, "event stream dropped (%s); reconnecting", termSafe(describe(msg.err)))
	case streamEndMsg:
		m.setStatus(true, "event stream ended: %s", termSafe(describe(msg.err)))
	case shellEndMsg:
		switch {
		case msg.err != nil:
			m.setStatus(true, "shell on %s: %s", termSafe(msg.name), termSafe(describe(msg.err)))
		default:
			m.setStatus(msg.code != 0, "shell on %s ended: exit %d", termSafe(msg.name), msg.code)
		}
		return m, m.refresh()
	case actionMsg:
		if msg.err != nil {
			m.setStatus(true, "%s failed: %s", termSafe(msg.what), termSafe(describe(msg.err)))
		} else {
			m.setStatus(false, "%s", termSafe(msg.what))
		}
		return m, m.refresh()
	case tea.KeyMsg:
		if m.prompt != promptNone {
			return m, m.promptKey(msg)
		}
		return m, m.key(msg)
	}
	return m, nil
}

func (m *watchModel) key(k tea.KeyMsg) tea.Cmd {
	m.status = "" // news stays until the next key
	switch k.String() {
	case "q", "ctrl+c", "esc":
		return tea.Quit
	case "up", "k":
		m.move(-1)
	case "down", "j":
		m.move(1)
	case "home", "g":
		m.move(-len(m.sandboxes))
	case "end", "G":
		m.move(len(m.sandboxes))
	case "a", "tab":
		m.allEvents = !m.allEvents
	case "s":
		return m.act("stopped", func(ctx context.Context, id string) error { _, err := m.c.StopSandbox(ctx, id); return err })
	case "r":
		return m.act("resumed", func(ctx context.Context, id string) error { _, err := m.c.ResumeSandbox(ctx, id); return err })
	case "e":
		if _, ok := m.current(); ok {
			m.prompt, m.input = promptExtend, nil
		}
	case "x":
		return m.shell()
	case "d":
		if _, ok := m.current(); ok {
			m.prompt, m.input = promptDelete, nil
		}
	case "/", "t":
		m.prompt, m.input = promptFilter, []rune(filterString(m.filter))
	}
	return nil
}

func (m *watchModel) promptKey(k tea.KeyMsg) tea.Cmd {
	p := m.prompt
	if p == promptDelete {
		m.prompt = promptNone
		if s, ok := m.current(); ok && (k.String() == "y" || k.String() == "Y") {
			return m.act("deleted", func(ctx context.Context, id string) error { _, err := m.c.DeleteSandbox(ctx, id); return err })
		} else if ok {
			m.setStatus(false, "%s kept: nothing deleted", termSafe(s.Name))
		}
		return nil
	}
	switch k.Type {
	case tea.KeyEsc, tea.KeyCtrlC:
		m.prompt = promptNone
		m.status = ""
		return nil
	case tea.KeyBackspace:
		if len(m.input) > 0 {
			m.input = m.input[:len(m.input)-1]
		}
		return nil
	case tea.KeyEnter:
		m.prompt = promptNone
		text := strings.TrimSpace(string(m.input))
		if p == promptFilter {
			sel, err := parseTagFilter(text)
			if err != nil {
				m.setStatus(true, "%s", termSafe(err.Error()))
				return nil
			}
			m.filter = sel
			m.offset = 0
			if len(sel) == 0 {
				m.setStatus(false, "filter cleared")
			} else {
				m.setStatus(false, "showing sandboxes with %s", termSafe(filterString(sel)))
			}
			return m.refresh()
		}
		d, err := client.ParseDuration(text)
		if err != nil || d < time.Second {
			m.setStatus(true, "lease %q: give a duration of at least 1s, e.g. 30m, 2h or 1d", termSafe(text))
			return nil
		}
		return m.act("extended", func(ctx context.Context, id string) error { _, err := m.c.SetTTL(ctx, id, d); return err })
	case tea.KeyRunes, tea.KeySpace:
		if len(m.input) < 200 {
			m.input = append(m.input, k.Runes...)
			if k.Type == tea.KeySpace {
				m.input = append(m.input, ' ')
			}
		}
	}
	return nil
}

func parseTagFilter(text string) (map[string]string, error) {
	if text == "" {
		return nil, nil
	}
	return parseTags(strings.FieldsFunc(text, func(r rune) bool { return r == ',' || r == ' ' }))
}

func filterString(sel map[string]string) string {
	parts := make([]string, 0, len(sel))
	for k, v := range sel {
		parts = append(parts, k+"="+v)
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

func (m *watchModel) current() (protocol.Sandbox, bool) {
	for _, s := range m.sandboxes {
		if s.ID == m.selected {
			return s, true
		}
	}
	return protocol.Sandbox{}, false
}

func (m *watchModel) index() int {
	for i, s := range m.sandboxes {
		if s.ID == m.selected {
			return i
		}
	}
	return -1
}

func (m *watchModel) move(by int) {
	if len(m.sandboxes) == 0 {
		return
	}
	i := min(max(m.index()+by, 0), len(m.sandboxes)-1)
	m.selected = m.sandboxes[i].ID
}

var (
	styleTitle    = lipgloss.NewStyle().Bold(true)
	styleHeader   = lipgloss.NewStyle().Bold(true).Underline(true)
	styleSelected = lipgloss.NewStyle().Reverse(true)
	styleWarn     = lipgloss.NewStyle().Foreground(lipgloss.Color("11")).Bold(true)
	styleBad      = lipgloss.NewStyle().Foreground(lipgloss.Color("9")).Bold(true)
	styleDim      = lipgloss.NewStyle().Faint(true)
)

// View lays the screen out in m.width x m.height: a title, the sandboxes (half of what is left),
// the events pane, and a footer with the keys, a prompt or the latest news.
func (m *watchModel) View() string {
	w, h := max(m.width, 20), max(m.height, 8)
	var lines []string
	title := fmt.Sprintf("sbctl watch  %s  %s", termSafe(m.broker), count(len(m.sandboxes), "sandbox", "sandboxes"))
	if len(m.filter) > 0 {
		title += "  tag " + termSafe(filterString(m.filter))
	}
	lines = append(lines, styleTitle.Render(fit(title, w)))

	listRows := (h - 4) / 2
	eventRows := h - 4 - listRows
	cols := m.columns(w)
	lines = append(lines, styleHeader.Render(fit(cols.row("  ", "NAME", "STATUS", "ISOLATION", "NODE", "LEASE", "TAGS"), w)))
	if i := m.index(); i >= 0 {
		if i < m.offset {
			m.offset = i
		} else if i >= m.offset+listRows {
			m.offset = i - listRows + 1
		}
	}
	m.offset = max(0, min(m.offset, len(m.sandboxes)-listRows))
	for r := 0; r < listRows; r++ {
		i := m.offset + r
		if i >= len(m.sandboxes) {
			if r == 0 {
				msg := "loading..."
				if m.loaded {
					msg = "no sandboxes (sbctl create NAME makes one)"
					if len(m.filter) > 0 {
						msg = "no sandbox has these tags (/ changes the filter)"
					}
				}
				lines = append(lines, styleDim.Render(fit(msg, w)))
				continue
			}
			lines = append(lines, "")
			continue
		}
		lines = append(lines, m.sandboxRow(m.sandboxes[i], cols, w))
	}

	scope := "all sandboxes"
	s, ok := m.current()
	if !m.allEvents && ok {
		scope = termSafe(s.Name)
	}
	rule := "── events: " + scope + " "
	lines = append(lines, styleTitle.Render(fit(rule+strings.Repeat("─", max(0, w-runewidth.StringWidth(rule))), w)))
	var evs []string
	for i := len(m.events) - 1; i >= 0 && len(evs) < eventRows; i-- {
		e := m.events[i]
		if !m.allEvents && (!ok || e.SandboxID != s.ID) {
			continue
		}
		if m.allEvents && len(m.filter) > 0 && !matchesAny(m.sandboxes, e.SandboxID) {
			continue // a tag filter narrows the org's events to the sandboxes it lists
		}
		evs = append(evs, fit(strings.ReplaceAll(eventLine(e, m.allEvents), "\t", "  "), w))
	}
	for i := len(evs) - 1; i >= 0; i-- { // oldest first, the newest at the bottom
		lines = append(lines, evs[i])
	}
	for len(lines) < 3+listRows+eventRows {
		lines = append(lines, "")
	}
	lines = append(lines, m.footer(w))
	return strings.Join(lines, "\n")
}

func (m *watchModel) footer(w int) string {
	s, _ := m.current()
	switch m.prompt {
	case promptDelete:
		return styleBad.Render(fit(fmt.Sprintf("Delete sandbox %s and all its files? [y/N]", termSafe(s.Name)), w))
	case promptExtend:
		return fit(fmt.Sprintf("New lease for %s (e.g. 30m, 2h, 1d): %s_", termSafe(s.Name), termSafe(string(m.input))), w)
	case promptFilter:
		return fit("Filter by tag (key=value, empty for all): "+termSafe(string(m.input))+"_", w)
	}
	if m.status != "" {
		status := termSafe(m.status) // its parts are escaped already; escaping twice changes nothing
		if m.statusErr {
			return styleBad.Render(fit(status, w))
		}
		return fit(status, w)
	}
	return styleDim.Render(fit("j/k select  s stop  r resume  e extend  d delete  x shell  / tag  a all  q quit", w))
}

// columns are the widths of the sandbox table for a screen w wide; NAME and TAGS take what is left.
type columns struct{ name, status, isolation, node, lease int }

func (m *watchModel) columns(w int) columns {
	c := columns{status: 13, isolation: 9, node: 15, lease: 7}
	rest := w - 2 - c.status - c.isolation - c.node - c.lease - 5*2
	c.name = min(max(rest*3/5, 8), 30)
	return c
}

// row lays out one line of the table; mark is "> " on the selected sandbox (visible without colour).
func (c columns) row(mark, name, status, isolation, node, lease, tags string) string {
	return mark + pad(name, c.name) + "  " + pad(status, c.status) + "  " + pad(isolation, c.isolation) + "  " +
		pad(node, c.node) + "  " + pad(lease, c.lease) + "  " + tags
}

func (m *watchModel) sandboxRow(s protocol.Sandbox, c columns, w int) string {
	status := s.Status
	switch {
	case s.Status != protocol.StatusStopped || s.StopReason == "" || s.StopReason == protocol.StopRequested:
	case s.StopReason == protocol.StopTTLExpired:
		status += " (ttl)"
	default:
		status += " (" + s.StopReason + ")"
	}
	if s.NodeStatus == protocol.NodeLost {
		status = "broker lost"
	}
	lease, warn := m.lease(s)
	mark := "  "
	if s.ID == m.selected {
		mark = "> "
	}
	row := fit(c.row(mark, termSafe(s.Name), termSafe(status), termSafe(s.Isolation), termSafe(m.nodeOf(s)), lease, tagString(s.Tags)), w)
	switch {
	case s.ID == m.selected:
		return styleSelected.Render(pad(row, w))
	case s.Status == protocol.StatusFailed || s.NodeStatus == protocol.NodeLost:
		return styleBad.Render(row)
	case warn:
		return styleWarn.Render(row)
	}
	return row
}

// lease is the time left on a running sandbox's lease, and whether it is about to run out: within
// a fifth of its TTL (at least 10 s, at most 5 min), or after the broker's own expiring warning.
func (m *watchModel) lease(s protocol.Sandbox) (string, bool) {
	if s.ExpiresAt == nil || s.Status != protocol.StatusRunning {
		return "-", false
	}
	left := s.ExpiresAt.Sub(m.now())
	ttl := time.Duration(s.TTLSeconds) * time.Second
	within := min(max(ttl/5, 10*time.Second), 5*time.Minute)
	_, warned := m.expiring[s.ID]
	warn := left <= within || warned
	text := compactDuration(left)
	if warn {
		text = "!" + text
	}
	return text, warn
}

// compactDuration is a countdown in at most 7 characters: 1h02m, 4m05s, 9s, 0s.
func compactDuration(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	d = d.Round(time.Second)
	switch {
	case d >= 24*time.Hour:
		return fmt.Sprintf("%dd%02dh", d/(24*time.Hour), (d%(24*time.Hour))/time.Hour)
	case d >= time.Hour:
		return fmt.Sprintf("%dh%02dm", d/time.Hour, (d%time.Hour)/time.Minute)
	case d >= time.Minute:
		return fmt.Sprintf("%dm%02ds", d/time.Minute, (d%time.Minute)/time.Second)
	}
	return fmt.Sprintf("%ds", d/time.Second)
}

func (m *watchModel) nodeOf(s protocol.Sandbox) string {
	if s.Placement != nil && s.Placement.Node != "" {
		return s.Placement.Node // where it runs says more than which broker reaches it
	}
	if n, ok := m.nodes[s.ID]; ok {
		return n
	}
	return nodeOf(s)
}

// nodeOf names the broker hosting a sandbox: the host of its dataplane URL.
func nodeOf(s protocol.Sandbox) string {
	if u, err := url.Parse(s.DataplaneURL); err == nil && u.Host != "" {
		return u.Host
	}
	return "-"
}

// fit cuts s to w terminal cells.
func fit(s string, w int) string {
	if runewidth.StringWidth(s) <= w {
		return s
	}
	return runewidth.Truncate(s, w, "…")
}

// pad cuts or fills s to exactly w cells.
func pad(s string, w int) string {
	s = fit(s, w)
	return s + strings.Repeat(" ", max(0, w-runewidth.StringWidth(s)))
}

// shellEndMsg says how a shell opened from the pane ended.
type shellEndMsg struct {
	name string
	code int
	err  error
}

// shell opens an interactive shell on the selected sandbox: Bubble Tea hands the terminal over
// (out of the alternate screen, input released) for the session, as to an external program, and
// takes it back when the shell ends.
func (m *watchModel) shell() tea.Cmd {
	s, ok := m.current()
	if !ok {
		return nil
	}
	if s.Status != protocol.StatusRunning {
		m.setStatus(true, "%s is %s: resume it (r) before opening a shell", termSafe(s.Name), termSafe(s.Status))
		return nil
	}
	x := &shellExec{ctx: m.ctx, c: m.c, id: s.ID, name: s.Name}
	return tea.Exec(x, func(err error) tea.Msg { return shellEndMsg{name: x.name, code: x.code, err: err} })
}

// shellExec is a shell session as a tea.ExecCommand.
type shellExec struct {
	ctx      context.Context
	c        *client.Client
	id, name string
	in       io.Reader
	out      io.Writer
	code     int
}

func (x *shellExec) SetStdin(r io.Reader)  { x.in = r }
func (x *shellExec) SetStdout(w io.Writer) { x.out = w }
func (x *shellExec) SetStderr(io.Writer)   {}

func (x *shellExec) Run() error {
	in, ok := x.in.(*os.File)
	if !ok || !term.IsTerminal(int(in.Fd())) {
		return errors.New("a shell needs a terminal, and the input of sbctl watch is not one")
	}
	fmt.Fprintf(x.out, "sbctl: shell on %s; exit or Ctrl-D returns to sbctl watch\r\n", termSafe(x.name))
	res, err := runShell(x.ctx, x.c, x.id, protocol.ShellArgs{}, in, x.out)
	x.code = res.ExitCode
	return err
}
