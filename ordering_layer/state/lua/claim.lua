-- Claim a partition for a new owner and read the state it recovers from.
--
-- KEYS[1]  epoch    string: owner epoch, incremented here
-- KEYS[2]  settled  zset: settled offsets above the committed offset
-- KEYS[3]  attempts hash: offset -> delivery attempts of unsettled messages
-- Returns {epoch, settled offsets..., '|', attempts as offset, count pairs...}
local epoch = redis.call('INCR', KEYS[1])
local out = {epoch}
for _, offset in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  table.insert(out, offset)
end
table.insert(out, '|')
for _, item in ipairs(redis.call('HGETALL', KEYS[3])) do
  table.insert(out, item)
end
return out
