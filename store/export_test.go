package store

import "github.com/redis/go-redis/v9"

// Raw is the store's client, for tests of this package that look at or damage keys directly.
func Raw(s *Store) redis.UniversalClient { return s.rdb }
