-- Mark scheduled messages done (activated, or a terminal state read back from the topic).
--
-- KEYS as in add.lua.
-- ARGV[1] when (ms), ARGV[2] ACTIVATED | CANCELLED, ARGV[3..] schedule ids
-- Returns the ids that became done now (not those done before, e.g. by another scheduler).
local fresh = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  if redis.call('HSETNX', KEYS[4], id, ARGV[2]) == 1 then
    redis.call('ZADD', KEYS[5], ARGV[1], id)
    table.insert(fresh, id)
  end
end
return fresh
