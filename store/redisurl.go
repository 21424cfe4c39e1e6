package store

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// ParseRedisURL reads --redis-url into options for go-redis' UniversalClient:
//
//	redis://[user:pass@]host:port[/db]               one server (rediss:// for TLS)
//	redis://h1:6379,redis://h2:6379  or  h1:6379,h2:6379   a Cluster (seed nodes)
//	redis-cluster://[user:pass@]h1:6379,h2:6379      a Cluster
//	redis-sentinel://[user:pass@]s1:26379,s2:26379/mymaster[?db=N]   a Sentinel group
func ParseRedisURL(raw string) (*redis.UniversalOptions, error) {
	raw = strings.TrimSpace(raw)
	bad := func(why string) error {
		return fmt.Errorf("--redis-url: %s; use redis://host:port, a comma list of nodes, redis-cluster://h1,h2 or redis-sentinel://h1,h2/master", why)
	}
	switch {
	case raw == "":
		return nil, bad("empty")
	case strings.HasPrefix(raw, "redis-sentinel://"), strings.HasPrefix(raw, "redis-cluster://"):
		scheme, rest, _ := strings.Cut(raw, "://")
		u, err := url.Parse("redis://" + rest)
		if err != nil {
			return nil, bad("cannot parse it")
		}
		o := &redis.UniversalOptions{Addrs: splitHosts(u.Host)}
		if u.User != nil {
			o.Username = u.User.Username()
			o.Password, _ = u.User.Password()
		}
		if scheme == "redis-sentinel" {
			o.MasterName = strings.Trim(u.Path, "/")
			if o.MasterName == "" {
				return nil, bad("a sentinel URL needs the master name as its path")
			}
			if db := u.Query().Get("db"); db != "" {
				n, err := strconv.Atoi(db)
				if err != nil || n < 0 {
					return nil, bad("db must be a database number")
				}
				o.DB = n
			}
		}
		if len(o.Addrs) == 0 {
			return nil, bad("no hosts")
		}
		if scheme == "redis-cluster" && o.MasterName == "" && len(o.Addrs) == 1 {
			o.IsClusterMode = true
		}
		return o, nil
	case strings.Contains(raw, ","):
		o := &redis.UniversalOptions{}
		for i, part := range strings.Split(raw, ",") {
			part = strings.TrimSpace(part)
			if !strings.Contains(part, "://") {
				part = "redis://" + part
			}
			one, err := redis.ParseURL(part)
			if err != nil {
				return nil, bad(fmt.Sprintf("node %d: %s", i+1, parseProblem(err)))
			}
			o.Addrs = append(o.Addrs, one.Addr)
			o.Username, o.Password, o.TLSConfig = one.Username, one.Password, one.TLSConfig
		}
		return o, nil
	}
	if !strings.Contains(raw, "://") {
		raw = "redis://" + raw
	}
	one, err := redis.ParseURL(raw)
	if err != nil {
		return nil, bad(parseProblem(err))
	}
	return &redis.UniversalOptions{Addrs: []string{one.Addr}, Username: one.Username, Password: one.Password,
		DB: one.DB, TLSConfig: cloneTLS(one.TLSConfig)}, nil
}

// parseProblem says what is wrong with a URL without quoting it: a *url.Error carries the whole
// URL, password included, and the broker prints this error at start.
func parseProblem(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err.Error()
	}
	return err.Error()
}

func splitHosts(h string) []string {
	var out []string
	for _, p := range strings.Split(h, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func cloneTLS(c *tls.Config) *tls.Config {
	if c == nil {
		return nil
	}
	return c.Clone()
}
