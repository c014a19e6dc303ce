-- Claim a partition for a new owner and read the state it recovers from; apply a pending seek.
--
-- KEYS[1]  epoch    string: owner epoch, raised here
-- KEYS[2]  settled  zset: settled offsets above the committed offset, and the floor (member '_',
--          see apply.lua): every offset below its score is settled
-- KEYS[3]  attempts hash: offset -> number of the last attempt of unsettled messages, negated while
--          that attempt waited in a callback pool (see apply.lua)
-- KEYS[4]  leases   hash: offset -> lease deadline (ms)
-- KEYS[5]  seek     hash: the partition's latest seek (GRP-3): gen, offset (the target), settled
--                   (comma-separated offsets above the target that count as settled), applied
--                   (the last gen whose target is committed in Kafka)
-- KEYS[6]  cascades set: offsets from which keys cascade (see apply.lua)
-- KEYS[7]  firsts   zset: runs of first attempts (see apply.lua)
-- ARGV[1]  ''       claim: a new owner, whatever the stored epoch;
--          <epoch>  re-claim for a pending seek: only by the owner of that epoch (a running
--                   subscriber, or the admin of an empty group that read it), and only when a seek
--                   is pending; returns {-1} when the stored epoch is another (fenced), {0} when no
--                   seek is pending (nothing changed)
-- ARGV[2]  '1': mark the pending seek applied here (the caller has committed its target already)
-- ARGV[3]  re-claim only: the seek generation expected ('' any); another pending one returns {0}
-- Returns {epoch, settled offsets..., '|', attempts as offset, count pairs..., '|', seek gen,
--          seek target offset (-1: no seek pending, start at the committed offset), '|',
--          cascade marks..., '|', floor (-1: none), '|', first-attempt runs...}
--
-- A pending seek (gen above applied) is applied with the claim, atomically: settled is replaced by
-- the seek's set (no floor: the owner starts at the target), attempts, leases and cascade marks are dropped (delivery attempts restart at 1,
-- ACK-6; what was delivered before the seek is not redelivered as a cascade), and the
-- new epoch fences every write of the ownership before the seek (ACK-5).
--
-- The new epoch is above the stored one and at least Redis's clock in microseconds (no two claims
-- run within one microsecond, so an epoch never runs ahead of the clock). So it is above every
-- epoch handed out before even when Redis lost the epoch key (a flush, a restart without
-- persistence): an earlier owner that lives on (a zombie) holds a lower epoch and stays fenced,
-- whatever order the two write in afterwards (apply.lua adopts only a higher epoch). Microseconds
-- since 1970 stay below 2^53, exact in a Lua number, until the year 2255.
local stored = tonumber(redis.call('GET', KEYS[1]) or '0')
local seek = redis.call('HMGET', KEYS[5], 'gen', 'offset', 'settled', 'applied')
local gen = tonumber(seek[1] or '0')
local pending = gen > tonumber(seek[4] or '0')
if ARGV[1] ~= '' then
  if stored ~= tonumber(ARGV[1]) then
    return {-1}
  end
  if not pending or (ARGV[3] ~= '' and gen ~= tonumber(ARGV[3])) then
    return {0}
  end
end
local clock = redis.call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local epoch = math.max(stored + 1, now_us)
redis.call('SET', KEYS[1], string.format('%d', epoch))
local target = -1
if pending then
  target = tonumber(seek[2])
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[6], KEYS[7])
  local pairs_ = {}
  for offset in string.gmatch(seek[3] or '', '%d+') do
    pairs_[#pairs_ + 1] = offset
    pairs_[#pairs_ + 1] = offset
  end
  local CHUNK = 4000  -- arguments per call (even, so pairs stay whole); keeps unpack() within Lua's stack
  for i = 1, #pairs_, CHUNK do
    redis.call('ZADD', KEYS[2], unpack(pairs_, i, math.min(i + CHUNK - 1, #pairs_)))
  end
  if ARGV[2] == '1' then
    redis.call('HSET', KEYS[5], 'applied', gen)
  end
end
local out = {epoch}
local floor = -1
for _, offset in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if offset == '_' then  -- the floor (apply.lua), not an offset
    floor = tonumber(redis.call('ZSCORE', KEYS[2], '_'))
  else
    table.insert(out, offset)
  end
end
table.insert(out, '|')
local fields = redis.call('HGETALL', KEYS[3])
for i = 1, #fields, 2 do
  if fields[i] ~= '_' then  -- the field that keeps the hash (apply.lua), not an offset
    table.insert(out, fields[i])
    table.insert(out, fields[i + 1])
  end
end
table.insert(out, '|')
table.insert(out, gen)
table.insert(out, target)
table.insert(out, '|')
for _, offset in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  table.insert(out, offset)
end
table.insert(out, '|')
table.insert(out, string.format('%d', floor))
table.insert(out, '|')
for _, run in ipairs(redis.call('ZRANGE', KEYS[7], 0, -1)) do
  table.insert(out, run)
end
return out
