package store

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Announcements between brokers go over Redis pub/sub (the channels in keys.go). They are best
// effort: a follower that is disconnected misses what is published meanwhile, so every user of them
// also has a periodic catch-up (re-verification, reconcile, polling).

// Publish sends each msg on channel, in one round trip. Their order is kept by one Redis, not by a
// Cluster (the pipeline's PUBLISHes go to several nodes at once): send what must stay in order with
// one call each.
func (s *Store) Publish(ctx context.Context, channel string, msgs ...string) error {
	var err error
	switch len(msgs) {
	case 0:
		return nil
	case 1:
		err = s.rdb.Publish(ctx, channel, msgs[0]).Err()
	default:
		pipe := s.rdb.Pipeline()
		for _, m := range msgs {
			pipe.Publish(ctx, channel, m)
		}
		_, err = pipe.Exec(ctx)
	}
	if err != nil {
		return fmt.Errorf("store: publish on %s: %w", channel, err)
	}
	return nil
}

// followHealthCheck is how often an idle subscription is pinged, so a connection that died silently
// (a peer gone behind a quiet network) is noticed and re-established.
const followHealthCheck = 5 * time.Second

// Follow subscribes to channel and calls fn with each message's payload, from one goroutine, in
// order, until ctx ends (the subscription is then closed). It returns once Redis has confirmed the
// subscription, so no message published after it returns is missed; an error means nothing is
// followed. A dropped connection is re-established and resubscribed by itself (messages published
// meanwhile are lost: see FollowWithGaps), and the connection's health is checked while idle. fn
// may block: messages wait meanwhile (a bounded buffer).
func (s *Store) Follow(ctx context.Context, channel string, fn func(payload string)) error {
	return s.FollowWithGaps(ctx, channel, fn, nil)
}

// FollowWithGaps is Follow, and calls gap (when not nil), on fn's goroutine, each time the
// subscription is confirmed again after a drop: what was published between the drop and then is
// lost, and every message after it is delivered, so a follower that catches up from Redis' state in
// gap misses nothing.
func (s *Store) FollowWithGaps(ctx context.Context, channel string, fn func(payload string), gap func()) error {
	sub := s.rdb.Subscribe(ctx, channel)
	if _, err := sub.Receive(ctx); err != nil {
		sub.Close()
		return fmt.Errorf("store: subscribe to %s: %w", channel, err)
	}
	// The first confirmation was read above: any later one is a resubscription.
	ch := sub.ChannelWithSubscriptions(redis.WithChannelHealthCheckInterval(followHealthCheck))
	go func() {
		defer sub.Close()
		for {
			select {
			case <-ctx.Done():
				return
			case msg, ok := <-ch:
				if !ok {
					return
				}
				switch m := msg.(type) {
				case *redis.Message:
					fn(m.Payload)
				case *redis.Subscription:
					if m.Kind == "subscribe" && gap != nil {
						gap()
					}
				}
			}
		}
	}()
	return nil
}
