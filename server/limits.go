package server

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// getLimits answers GET /v1/limits: the caller's org's limits (its own, else the broker's defaults)
// and what it uses of them now.
func (s *Server) getLimits(c echo.Context) error {
	ctx, org := c.Request().Context(), principal(c).Org
	own, err := s.store.OrgLimits(ctx, org)
	if err != nil {
		return err
	}
	running, err := s.store.Running(ctx, org)
	if err != nil {
		return err
	}
	sandboxes, err := s.store.Sandboxes(ctx, org)
	if err != nil {
		return err
	}
	l := s.store.DefaultLimits().With(own)
	res := protocol.LimitsResponse{Org: org, Usage: protocol.LimitsUsage{Running: running, Sandboxes: sandboxes}, Own: []string{}}
	for _, name := range store.LimitNames {
		if _, ok := own[name]; ok {
			res.Own = append(res.Own, name)
		}
	}
	res.Limits = protocol.OrgLimits{MaxRunning: l.MaxRunning, MaxSandboxes: l.MaxSandboxes, RPS: l.RPS, Burst: l.Burst, Connections: l.Connections}
	return c.JSON(http.StatusOK, res)
}

// Limit names in metrics: which limit refused a request.
const (
	limitMaxRunning   = "max_running"
	limitRPS          = "rps"
	limitAuthFailures = "auth_failures"
)

// limitMetrics are the limits' Prometheus metrics: refusals by limit and org (orgs exist only by an
// operator's `broker keys create`, so their number is the operator's, not a caller's), the running
// sandboxes of every org, and the sizes of the in-memory tables.
type limitMetrics struct {
	refusals *prometheus.CounterVec
	// sourceRefusals counts connections refused for their source's cap (sourceLimiter).
	sourceRefusals prometheus.Counter
}

func (s *Server) registerLimitMetrics(reg *prometheus.Registry) {
	s.limitMetrics = &limitMetrics{refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sbx_limit_refusals_total",
		Help: "Requests refused by a limit: limit is max_running, rps or auth_failures; org is empty for auth_failures (the caller is unknown).",
	}, []string{"limit", "org"}),
		sourceRefusals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sbx_connections_refused_total",
			Help: "Connections refused at accept because their source address held --max-connections-per-source already.",
		})}
	reg.MustRegister(s.limitMetrics.refusals, s.limitMetrics.sourceRefusals,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sbx_rate_limit_credentials", Help: "Credentials with a request bucket in this broker's memory."},
			func() float64 { return float64(s.buckets.size()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sbx_auth_failure_sources", Help: "Source addresses with failed authentications tracked in this broker's memory."},
			func() float64 {
				if s.authGuard == nil {
					return 0
				}
				return float64(s.authGuard.size())
			}),
		&runningCollector{st: s.store})
}

// countRefusal counts a 429 answer by the limit that refused it.
func (s *Server) countRefusal(c echo.Context, err error) {
	var re *retryError
	var le *sandbox.LimitError
	var pe *protocol.Error
	switch {
	case errors.As(err, &re) && re.limit != "":
		s.limitMetrics.refusals.WithLabelValues(re.limit, re.org).Inc()
	case errors.As(err, &le):
		s.limitMetrics.refusals.WithLabelValues(le.Limit, principal(c).Org).Inc()
	case errors.As(err, &pe) && pe.Code == protocol.CodeQuotaExceeded:
		s.limitMetrics.refusals.WithLabelValues(limitMaxRunning, principal(c).Org).Inc()
	}
}

// runningCollector reports every org's sandboxes provisioning or running (what max_running bounds)
// at scrape time, from Redis, so every broker reports the same numbers. It reads at most
// maxOrgsScraped orgs.
type runningCollector struct{ st *store.Store }

const maxOrgsScraped = 10_000

var runningDesc = prometheus.NewDesc("sbx_org_running_sandboxes",
	"Sandboxes provisioning or running per org, on every broker (what the org's max_running limit counts).", []string{"org"}, nil)

func (rc *runningCollector) Describe(ch chan<- *prometheus.Desc) { ch <- runningDesc }

func (rc *runningCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	counts, err := rc.st.RunningByOrg(ctx, maxOrgsScraped)
	if err != nil {
		return // Redis away: /readyz says so; the scrape still gets the other metrics
	}
	for org, n := range counts {
		ch <- prometheus.MustNewConstMetric(runningDesc, prometheus.GaugeValue, float64(n), org)
	}
}
