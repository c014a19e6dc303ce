-- Claim a partition for a new owner and read the state it recovers from.
--
-- KEYS[1]  epoch    string: owner epoch, raised here
-- KEYS[2]  settled  zset: settled offsets above the committed offset
-- KEYS[3]  attempts hash: offset -> number of the last attempt of unsettled messages, negated while
--          that attempt waited in a callback pool (see apply.lua)
-- Returns {epoch, settled offsets..., '|', attempts as offset, count pairs...}
--
-- The new epoch is above the stored one and at least Redis's clock in microseconds (no two claims
-- run within one microsecond, so an epoch never runs ahead of the clock). So it is above every
-- epoch handed out before even when Redis lost the epoch key (a flush, a restart without
-- persistence): an earlier owner that lives on (a zombie) holds a lower epoch and stays fenced,
-- whatever order the two write in afterwards (apply.lua adopts only a higher epoch). Microseconds
-- since 1970 stay below 2^53, exact in a Lua number, until the year 2255.
local clock = redis.call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local epoch = math.max(tonumber(redis.call('GET', KEYS[1]) or '0') + 1, now_us)
redis.call('SET', KEYS[1], string.format('%d', epoch))
local out = {epoch}
for _, offset in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  table.insert(out, offset)
end
table.insert(out, '|')
for _, item in ipairs(redis.call('HGETALL', KEYS[3])) do
  table.insert(out, item)
end
return out
