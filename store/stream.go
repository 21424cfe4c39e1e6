package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"
)

// The event log: one Redis stream per org (EventsKey), each entry one event's JSON under the field
// "data". Package events decides what goes in and how it is read; this file is the Redis half.

// StreamEntry is one entry of an org's event stream: its id (the stream's "ms-seq") and data.
type StreamEntry struct {
	ID   string
	Data string
}

// StreamAppend is one event to append to an org's stream.
type StreamAppend struct {
	Org  string
	Data []byte
}

// AppendEvents appends a batch to the org streams in one round trip, in order, each stream trimmed
// to about maxLen entries (MAXLEN ~). It answers, per entry, whether it was appended: when Redis
// goes away the batch's tail fails and may be retried (what was appended must not be, or it would be
// there twice). err is the batch's first error, if any.
func (s *Store) AppendEvents(ctx context.Context, batch []StreamAppend, maxLen int64) (appended []bool, err error) {
	return s.appendEvents(ctx, batch, maxLen, "")
}

// AppendEventsAndWake is AppendEvents followed by a publish on channel of the names of the orgs
// appended to, which wakes every broker's readers of those streams. On one Redis server both go in
// one pipeline: the server runs its commands in order, so the wake-up never overtakes an append,
// and the batch costs one round trip. On Cluster a pipeline's commands run on several nodes at
// once, so the wake-up is sent after the appends have returned. A wake-up for an append that
// failed finds nothing new; a lost one delays events by the readers' poll interval at most.
func (s *Store) AppendEventsAndWake(ctx context.Context, batch []StreamAppend, maxLen int64, channel string) (appended []bool, err error) {
	if _, cluster := s.rdb.(*redis.ClusterClient); !cluster {
		return s.appendEvents(ctx, batch, maxLen, channel)
	}
	appended, err = s.appendEvents(ctx, batch, maxLen, "")
	var orgs []string
	for i, a := range batch {
		if appended[i] && !slices.Contains(orgs, a.Org) {
			orgs = append(orgs, a.Org)
		}
	}
	if perr := s.Publish(ctx, channel, orgs...); perr != nil && err == nil {
		err = perr
	}
	return appended, err
}

// appendEvents appends batch in one pipeline and, when channel is set, publishes on it the names of
// the orgs of the batch, in the same pipeline after the appends.
func (s *Store) appendEvents(ctx context.Context, batch []StreamAppend, maxLen int64, channel string) (appended []bool, err error) {
	pipe := s.rdb.Pipeline()
	cmds := make([]*redis.StringCmd, len(batch))
	var orgs []string
	for i, a := range batch {
		cmds[i] = pipe.XAdd(ctx, &redis.XAddArgs{Stream: EventsKey(a.Org), MaxLen: maxLen, Approx: true, Values: []any{"data", a.Data}})
		if channel != "" && !slices.Contains(orgs, a.Org) {
			orgs = append(orgs, a.Org)
		}
	}
	for _, org := range orgs {
		pipe.Publish(ctx, channel, org)
	}
	_, err = pipe.Exec(ctx)
	appended = make([]bool, len(batch))
	for i, c := range cmds {
		appended[i] = c.Err() == nil
	}
	return appended, err
}

// EventsAfter reads up to n entries of org's stream after the id after (exclusive), oldest first;
// n <= 0 reads to the end.
func (s *Store) EventsAfter(ctx context.Context, org, after string, n int64) ([]StreamEntry, error) {
	var msgs []redis.XMessage
	var err error
	if n > 0 {
		msgs, err = s.rdb.XRangeN(ctx, EventsKey(org), "("+after, "+", n).Result()
	} else {
		msgs, err = s.rdb.XRange(ctx, EventsKey(org), "("+after, "+").Result()
	}
	if err != nil {
		return nil, fmt.Errorf("store: read events: %w", err)
	}
	return entries(msgs), nil
}

// LatestEvents reads the last n entries of org's stream, newest first.
func (s *Store) LatestEvents(ctx context.Context, org string, n int64) ([]StreamEntry, error) {
	msgs, err := s.rdb.XRevRangeN(ctx, EventsKey(org), "+", "-", n).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("store: read events: %w", err)
	}
	return entries(msgs), nil
}

// StreamInfo describes an org's event stream: the last id it generated, its oldest entry left, how
// many entries were ever added and how many it holds (more added than held: some were trimmed).
type StreamInfo struct {
	LastGeneratedID string
	FirstID         string
	EntriesAdded    int64
	Length          int64
}

// EventsInfo describes org's event stream; ErrNotFound when it does not exist.
func (s *Store) EventsInfo(ctx context.Context, org string) (StreamInfo, error) {
	info, err := s.rdb.XInfoStream(ctx, EventsKey(org)).Result()
	if err != nil {
		if strings.Contains(err.Error(), "no such key") {
			return StreamInfo{}, ErrNotFound
		}
		return StreamInfo{}, fmt.Errorf("store: read the event stream: %w", err)
	}
	return StreamInfo{LastGeneratedID: info.LastGeneratedID, FirstID: info.FirstEntry.ID, EntriesAdded: info.EntriesAdded, Length: info.Length}, nil
}

func entries(msgs []redis.XMessage) []StreamEntry {
	if len(msgs) == 0 {
		return nil
	}
	out := make([]StreamEntry, len(msgs))
	for i, m := range msgs {
		data, _ := m.Values["data"].(string)
		out[i] = StreamEntry{ID: m.ID, Data: data}
	}
	return out
}
