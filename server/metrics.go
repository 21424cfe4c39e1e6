package server

import (
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are the broker's Prometheus metrics, on a registry of its own (no global state, so tests can
// run several servers in one process).
type metrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
}

// newMetrics makes the registry; dpConns reads the open dataplane connections (hub.count), which
// are counted once, by the hub.
func newMetrics(dpConns func() int) *metrics {
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
	m.reg.MustRegister(m.requests, m.latency, conns, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) observe(method, route string, status int, d time.Duration) {
	m.requests.WithLabelValues(method, route, strconv.Itoa(status)).Inc()
	m.latency.WithLabelValues(route).Observe(d.Seconds())
}

func (m *metrics) handler() echo.HandlerFunc {
	return echo.WrapHandler(promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
}
