package store_test

import (
	"strings"
	"testing"

	"github.com/sbxbroker/broker/store"
)

func TestParseRedisURL(t *testing.T) {
	for _, tc := range []struct {
		in            string
		addrs         string
		master, pass  string
		db            int
		cluster, fail bool
	}{
		{in: "redis://10.0.0.5:6379", addrs: "10.0.0.5:6379"},
		{in: "redis://:s3cret@h:6380/2", addrs: "h:6380", pass: "s3cret", db: 2},
		{in: "h:6379", addrs: "h:6379"},
		{in: "redis://a:1,redis://b:2", addrs: "a:1,b:2"},
		{in: "a:1,b:2,c:3", addrs: "a:1,b:2,c:3"},
		{in: "redis-cluster://x:1,y:2", addrs: "x:1,y:2"},
		{in: "redis-cluster://one:7000", addrs: "one:7000", cluster: true},
		{in: "redis-sentinel://:pw@s1:26379,s2:26379/mymaster", addrs: "s1:26379,s2:26379", master: "mymaster", pass: "pw"},
		{in: "redis-sentinel://s1:26379/m?db=3", addrs: "s1:26379", master: "m", db: 3},
		{in: "redis-sentinel://s1:26379", fail: true},
		{in: "redis-sentinel://s1:26379/m?db=x", fail: true},
		{in: "redis://:s3cret@h:notaport", fail: true},
		{in: "a:1,redis://:s3cret@h:notaport", fail: true},
		{in: "", fail: true},
		{in: "redis://h:notaport", fail: true},
	} {
		o, err := store.ParseRedisURL(tc.in)
		if tc.fail {
			if err == nil || !strings.Contains(err.Error(), "--redis-url") {
				t.Errorf("%q: want an error naming --redis-url, got %v", tc.in, err)
			}
			if err != nil && strings.Contains(err.Error(), "s3cret") {
				t.Errorf("%q: the error shows the password: %v", tc.in, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		if got := strings.Join(o.Addrs, ","); got != tc.addrs || o.MasterName != tc.master || o.Password != tc.pass || o.DB != tc.db || o.IsClusterMode != tc.cluster {
			t.Errorf("%q: got %+v", tc.in, o)
		}
	}
}
