package store

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrBadCursor is a list cursor that this store did not produce.
var ErrBadCursor = errors.New("store: malformed cursor")

// Filter selects sandboxes in List. All conditions must hold.
type Filter struct {
	Tags     map[string]string
	Statuses []string
}

// Page is one page of List.
type Page struct {
	Records []Record
	// Next continues the listing; empty on the last page.
	Next string
}

// maxScan bounds the index entries one List call examines, so a selective filter over a huge org
// costs a bounded amount per round trip; a page may then come back short with a Next cursor.
const maxScan = 2000

// listScript walks one index (all sandboxes, or the sandboxes of one tag) in creation order from a
// cursor, keeps those that are in every other tag index and have an allowed status, and returns up to
// limit records.
// KEYS: 1 the index walked, 2.. other tag indexes that must contain the id.
// ARGV: 1 cursor score (ms), 2 cursor id ("" = start), 3 limit, 4 allowed statuses ("" = any),
// 5 sandbox key prefix, 6 scan budget.
// Answers {next_score, next_id, n, HGETALL-array x n}; next_id "" means the end.
var listScript = redis.NewScript(`
local score, lastid, limit, prefix, budget = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[5], tonumber(ARGV[6])
local statuses = {}
local anystatus = ARGV[4] == ''
for s in string.gmatch(ARGV[4], '[^,]+') do statuses[s] = true end
local out, found, scanned = {}, 0, 0
local function consider(id)
  for i = 2, #KEYS do
    if not redis.call('ZSCORE', KEYS[i], id) then return end
  end
  local key = prefix .. id
  if not anystatus and not statuses[redis.call('HGET', key, 'status')] then return end
  local rec = redis.call('HGETALL', key)
  if #rec > 0 then
    out[#out + 1] = rec
    found = found + 1
  end
end
-- Members that share the cursor's score come in id order: finish those first.
if lastid ~= '' then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], score, score, 'BYSCORE')) do
    if id > lastid then
      scanned = scanned + 1
      consider(id)
      if found >= limit or scanned >= budget then return {score, id, found, unpack(out)} end
    end
  end
end
local from = '(' .. score
if lastid == '' then from = score end
while true do
  local batch = redis.call('ZRANGE', KEYS[1], from, '+inf', 'BYSCORE', 'LIMIT', 0, 100, 'WITHSCORES')
  if #batch == 0 then return {'', '', found, unpack(out)} end
  for i = 1, #batch, 2 do
    scanned = scanned + 1
    consider(batch[i])
    if found >= limit or scanned >= budget then
      -- More may follow; the caller learns it from the next (possibly empty) page.
      return {batch[i + 1], batch[i], found, unpack(out)}
    end
    from = '(' .. batch[i + 1]
  end
  -- The last score may be shared by members beyond this batch: resume at it, after the last id.
  local lastscore, lid = batch[#batch], batch[#batch - 1]
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], lastscore, lastscore, 'BYSCORE')) do
    if id > lid then
      scanned = scanned + 1
      consider(id)
      if found >= limit or scanned >= budget then return {lastscore, id, found, unpack(out)} end
    end
  end
  from = '(' .. lastscore
end
`)

// List returns sandboxes of org matching f in creation order, limit at a time.
func (s *Store) List(ctx context.Context, org string, f Filter, limit int, cursor string) (Page, error) {
	score, lastID, err := decodeCursor(cursor)
	if err != nil {
		return Page{}, err
	}
	keys := []string{AllKey(org)}
	tagKeys := make([]string, 0, len(f.Tags))
	for k, v := range f.Tags {
		tagKeys = append(tagKeys, TagKey(org, k, v))
	}
	sort.Strings(tagKeys)
	if len(tagKeys) > 0 {
		keys = tagKeys // walk the first tag index, check the others
	}
	v, err := listScript.Run(ctx, s.rdb, keys, score, lastID, limit, strings.Join(f.Statuses, ","),
		sandboxPrefix(org), maxScan).Slice()
	if err != nil {
		return Page{}, fmt.Errorf("store: list: %w", err)
	}
	var p Page
	if id := str(v[1]); id != "" {
		p.Next = encodeCursor(str(v[0]), id)
	}
	for _, raw := range v[3:] {
		r, err := parseRecord(raw)
		if err != nil {
			return Page{}, err
		}
		p.Records = append(p.Records, r)
	}
	return p, nil
}

// ListAll pages through every sandbox matching f.
func (s *Store) ListAll(ctx context.Context, org string, f Filter) ([]Record, error) {
	var all []Record
	cursor := ""
	for {
		p, err := s.List(ctx, org, f, 500, cursor)
		if err != nil {
			return nil, err
		}
		all = append(all, p.Records...)
		if p.Next == "" {
			return all, nil
		}
		cursor = p.Next
	}
}

func encodeCursor(score, id string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(score + ":" + id))
}

func decodeCursor(c string) (score, id string, err error) {
	if c == "" {
		return "0", "", nil
	}
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return "", "", ErrBadCursor
	}
	score, id, ok := strings.Cut(string(b), ":")
	if _, perr := strconv.ParseInt(score, 10, 64); !ok || perr != nil || !strings.HasPrefix(id, "sb_") || len(id) > 64 {
		return "", "", ErrBadCursor
	}
	return score, id, nil
}

// Expired returns up to limit ids of org's running sandboxes whose deadline is at or before t.
func (s *Store) Expired(ctx context.Context, org string, t time.Time, limit int) ([]string, error) {
	return s.rangeIDs(ctx, DeadlinesKey(org), "-inf", strconv.FormatInt(ms(t), 10), limit)
}

// StoppedBefore returns up to limit ids of org's sandboxes stopped at or before t (for retention).
func (s *Store) StoppedBefore(ctx context.Context, org string, t time.Time, limit int) ([]string, error) {
	return s.rangeIDs(ctx, StoppedKey(org), "-inf", strconv.FormatInt(ms(t), 10), limit)
}

func (s *Store) rangeIDs(ctx context.Context, key, min, max string, limit int) ([]string, error) {
	ids, err := s.rdb.ZRangeArgs(ctx, redis.ZRangeArgs{Key: key, ByScore: true, Start: min, Stop: max, Count: int64(limit)}).Result()
	if err != nil {
		return nil, fmt.Errorf("store: range %s: %w", key, err)
	}
	return ids, nil
}
