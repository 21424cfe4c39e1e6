package server

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
)

// metrics are the broker's Prometheus metrics, on a registry of its own (no global state, so tests can
// run several servers in one process).
type metrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
}

// newMetrics makes the registry; dpConns reads the open dataplane connections (hub.count), which
// are counted once, by the hub. prov labels the provider metrics, so that an alert can fire on
// sandboxes that are not isolated or not limited.
func newMetrics(dpConns func() int, prov ProviderInfo) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sbx_http_requests_total", Help: "REST requests by route, method and status.",
		}, []string{"method", "route", "status"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sbx_http_request_seconds", Help: "REST request latency by route.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .5, 1, 5},
		}, []string{"route"}),
	}
	conns := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sbx_dataplane_connections", Help: "Open dataplane connections."},
		func() float64 { return float64(dpConns()) })
	info := prometheus.NewGauge(prometheus.GaugeOpts{Name: "sbx_provider_info",
		Help:        "The sandbox provider this broker runs, with its isolation level (none: sandboxes run on the host with no isolation); always 1.",
		ConstLabels: prometheus.Labels{"provider": prov.Name, "isolation": prov.Isolation}})
	info.Set(1)
	levels := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "sbx_isolation_level_available",
		Help: "1 for each isolation level this broker's host can run sandboxes at (namespace, gvisor, microvm), 0 for the others."},
		[]string{"level"})
	for _, l := range prov.Levels {
		v := 0.0
		if l.Available {
			v = 1
		}
		levels.WithLabelValues(l.Level).Set(v)
	}
	limits := prometheus.NewGauge(prometheus.GaugeOpts{Name: "sbx_provider_limits_enforced",
		Help: "1 when memory, pids and cpu limits apply to sandboxes, 0 when they do not."})
	fallback := prometheus.NewGauge(prometheus.GaugeOpts{Name: "sbx_provider_fallback",
		Help: "1 when the broker runs the dir provider because preflight fell back to it: the host could not run namespace sandboxes."})
	if prov.LimitsEnforced {
		limits.Set(1)
	}
	if prov.Fallback != "" {
		fallback.Set(1)
	}
	discards := prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "sbx_gvisor_relay_discarded_frames_total",
		Help: "Frames the gvisor sandboxes' stream bridges discarded for a channel not open on their side: 0 unless the relay or the bridge has a defect (the broker log says which sandbox)."},
		func() float64 { return float64(sandbox.GvisorRelayDiscards()) })
	m.reg.MustRegister(m.requests, m.latency, conns, discards, info, levels, limits, fallback, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// providerStartCounters export the provider's part of creates (sandbox.Manager.ProviderStarts):
// beside sbx_http_request_seconds of POST /v1/sandboxes, they tell the broker's own work on a
// create (HTTP, Redis, events) from the provider's.
func providerStartCounters(m *sandbox.Manager) []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "sbx_provider_starts_total",
			Help: "Sandboxes the provider created and started for creates (not warm-pool fills or claims)."},
			func() float64 { n, _ := m.ProviderStarts(); return float64(n) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "sbx_provider_start_seconds_total",
			Help: "Time those took in the provider, from its create until the sandbox could exec."},
			func() float64 { _, took := m.ProviderStarts(); return took.Seconds() }),
	}
}

// otherLabel stands for every method and route the broker does not serve.
const otherLabel = "other"

// knownMethods are the method names that may be label values. Any other name is the caller's
// invention (net/http accepts any token as a method, without credentials), and each distinct label
// value is a series kept for the life of the process: 300 requests with 500 KB method names held
// 270 MiB.
var knownMethods = map[string]bool{
	http.MethodGet: true, http.MethodHead: true, http.MethodPost: true, http.MethodPut: true,
	http.MethodPatch: true, http.MethodDelete: true, http.MethodOptions: true, http.MethodConnect: true,
	http.MethodTrace: true,
}

// methodLabel is method if it is a standard one, else otherLabel.
func methodLabel(method string) string {
	if knownMethods[method] {
		return method
	}
	return otherLabel
}

// observe counts a request. route must be a registered route or otherLabel (routeLabel).
func (m *metrics) observe(method, route string, status int, d time.Duration) {
	m.requests.WithLabelValues(methodLabel(method), route, strconv.Itoa(status)).Inc()
	m.latency.WithLabelValues(route).Observe(d.Seconds())
}

// handler serves /metrics. It answers on the API's own listener, which every tenant reaches, so
// series labelled with an org (its running sandboxes, its refusals), which would name every org on
// the broker and its activity to any caller, are served only to a request that carries the
// operator's metrics token (its SHA-256 is tokenHash; nil: no token, and those series are never
// served). Everything else is served without credentials, as Prometheus scrapes expect.
func (m *metrics) handler(tokenHash []byte) echo.HandlerFunc {
	full := promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
	public := promhttp.HandlerFor(withoutOrgSeries{m.reg}, promhttp.HandlerOpts{})
	return func(c echo.Context) error {
		r := c.Request()
		if r.Header.Get(echo.HeaderAuthorization) == "" {
			public.ServeHTTP(c.Response(), r)
			return nil
		}
		if tokenHash == nil {
			return protocol.Errorf(protocol.CodeUnauthenticated,
				"this broker has no metrics token (broker --metrics-token-file): /metrics answers without credentials, with no per-org series")
		}
		sum := sha256.Sum256([]byte(bearer(r)))
		if subtle.ConstantTimeCompare(sum[:], tokenHash) != 1 {
			return protocol.Errorf(protocol.CodeUnauthenticated,
				"invalid metrics token: send Authorization: Bearer <the token in the broker's --metrics-token-file>, or no credentials for the series that name no org")
		}
		full.ServeHTTP(c.Response(), r)
		return nil
	}
}

// withoutOrgSeries gathers every series but those labelled with a non-empty org.
type withoutOrgSeries struct{ g prometheus.Gatherer }

func (w withoutOrgSeries) Gather() ([]*dto.MetricFamily, error) {
	mfs, err := w.g.Gather()
	kept := mfs[:0]
	for _, mf := range mfs {
		series := mf.Metric[:0]
		for _, m := range mf.Metric {
			if !namesOrg(m) {
				series = append(series, m)
			}
		}
		if len(series) > 0 {
			mf.Metric = series
			kept = append(kept, mf)
		}
	}
	return kept, err
}

func namesOrg(m *dto.Metric) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == "org" && l.GetValue() != "" {
			return true
		}
	}
	return false
}
