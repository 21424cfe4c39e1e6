package store

import (
	"context"
	"fmt"
)

// RegisterNode records the base URL a broker is reached at, so any broker can build the dataplane
// URL of a sandbox hosted by another.
func (s *Store) RegisterNode(ctx context.Context, node, url string) error {
	if err := s.rdb.HSet(ctx, NodesKey, node, url).Err(); err != nil {
		return fmt.Errorf("store: register node: %w", err)
	}
	return nil
}

// NodeURL is the base URL of a broker, or ErrNotFound.
func (s *Store) NodeURL(ctx context.Context, node string) (string, error) {
	u, err := s.rdb.HGet(ctx, NodesKey, node).Result()
	if isNil(err) {
		return "", ErrNotFound
	}
	if err != nil {
		return "", fmt.Errorf("store: node url: %w", err)
	}
	return u, nil
}
