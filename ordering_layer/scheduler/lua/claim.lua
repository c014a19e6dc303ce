-- Claim due scheduled messages for activation, with a lease.
--
-- KEYS as in add.lua.
-- ARGV[1] now (ms), ARGV[2] lease deadline (ms), ARGV[3] most ids to claim
-- Claims first the ids whose lease expired (their scheduler died), then due ids by enqueue_at;
-- a claimed id never goes back to due, so it can no longer be cancelled.
-- Returns {-2} while the index is not built, else {next, id1, record1, id2, record2, ...} where
-- next is the earliest enqueue_at or lease deadline left (ms), or -1 when there is none.
if redis.call('EXISTS', KEYS[6]) == 0 then
  return {-2}
end
local limit = tonumber(ARGV[3])
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, limit)
if #ids < limit then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, limit - #ids)) do
    table.insert(ids, id)
  end
end
local out = {-1}
for _, id in ipairs(ids) do
  local record = redis.call('HGET', KEYS[3], id)
  redis.call('ZREM', KEYS[1], id)
  if record then
    redis.call('ZADD', KEYS[2], ARGV[2], id)
    table.insert(out, id)
    table.insert(out, record)
  else
    redis.call('ZREM', KEYS[2], id)
  end
end
for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if first[2] then
    local score = tonumber(first[2])
    if out[1] == -1 or score < out[1] then
      out[1] = score
    end
  end
end
return out
