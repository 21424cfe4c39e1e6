package server

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sbxbroker/broker/sandbox"
)

// poolCollector reports each template's warm pool on this broker at scrape time (sandbox/pool.go):
// what waits ready, what is starting, the target size, and the claims, misses and failed fills so
// far. Pooled sandboxes belong to no org, so no org's metrics or lists count them.
type poolCollector struct{ m *sandbox.Manager }

var (
	poolReadyDesc    = prometheus.NewDesc("sbx_pool_ready", "Sandboxes started and waiting in the template's warm pool on this broker.", []string{"template"}, nil)
	poolStartingDesc = prometheus.NewDesc("sbx_pool_starting", "Sandboxes being started for the template's warm pool.", []string{"template"}, nil)
	poolSizeDesc     = prometheus.NewDesc("sbx_pool_size", "The template's warm pool size (its pool.size).", []string{"template"}, nil)
	poolClaimsDesc   = prometheus.NewDesc("sbx_pool_claims_total", "Creates served from the template's warm pool.", []string{"template"}, nil)
	poolMissesDesc   = prometheus.NewDesc("sbx_pool_misses_total", "Creates that found the template's warm pool empty and started a sandbox.", []string{"template"}, nil)
	poolErrorsDesc   = prometheus.NewDesc("sbx_pool_fill_errors_total", "Failed starts of warm-pool sandboxes (the broker log says why).", []string{"template"}, nil)
)

func (pc *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{poolReadyDesc, poolStartingDesc, poolSizeDesc, poolClaimsDesc, poolMissesDesc, poolErrorsDesc} {
		ch <- d
	}
}

func (pc *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range pc.m.PoolStats() {
		ch <- prometheus.MustNewConstMetric(poolReadyDesc, prometheus.GaugeValue, float64(s.Ready), s.Template)
		ch <- prometheus.MustNewConstMetric(poolStartingDesc, prometheus.GaugeValue, float64(s.Starting), s.Template)
		ch <- prometheus.MustNewConstMetric(poolSizeDesc, prometheus.GaugeValue, float64(s.Size), s.Template)
		ch <- prometheus.MustNewConstMetric(poolClaimsDesc, prometheus.CounterValue, float64(s.Claims), s.Template)
		ch <- prometheus.MustNewConstMetric(poolMissesDesc, prometheus.CounterValue, float64(s.Misses), s.Template)
		ch <- prometheus.MustNewConstMetric(poolErrorsDesc, prometheus.CounterValue, float64(s.FillErrors), s.Template)
	}
}
