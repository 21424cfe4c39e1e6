package protocol

import "testing"

func TestRedactURL(t *testing.T) {
	for in, want := range map[string]string{
		"http://127.0.0.1:7070":                "http://127.0.0.1:7070",
		"http://u:s3cret@host:7070/x":          "http://u:xxxxx@host:7070/x",
		"redis://:s3cret@h1,h2:6379/0":         "redis://:xxxxx@h1,h2:6379/0",
		"ws://host/v1/dp?token=s3cret":         "ws://host/v1/dp",
		"http://u:s3cret@host:bad port":        "http://xxxxx@host:bad port",
		"redis-sentinel://h1,h2/master?db=2":   "redis-sentinel://h1,h2/master",
		"not a url with s3cret@ but no scheme": "not a url with s3cret@ but no scheme",
	} {
		if got := RedactURL(in); got != want {
			t.Errorf("RedactURL(%q) = %q, want %q", in, got, want)
		}
	}
}
