-- Forget terminal states older than the retention (their tombstones are written next).
--
-- KEYS as in add.lua.
-- ARGV[1] done before (ms), ARGV[2] most ids
-- Returns the ids forgotten.
local ids = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[5], id)
  redis.call('HDEL', KEYS[4], id)
end
return ids
