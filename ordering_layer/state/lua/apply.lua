-- Apply a batch of subscriber state changes for one (subscription, partition), fenced by epoch.
--
-- KEYS[1]  epoch    string: owner epoch of the partition (INCR on each claim)
-- KEYS[2]  settled  zset: offsets acked or dead-lettered above the committed offset (score = offset),
--          and the floor: the member '_', whose score is the owner's commit point as of its last
--          flush (everything below it is settled; only offsets settled above it are kept)
-- KEYS[3]  attempts hash: offset -> n, the number of the offset's last attempt (unsettled messages
--          only): n when user code has it (handed out by a pull, or started by a callback worker),
--          -n while it waits in a callback pool (user code not yet seen to start it)
-- KEYS[4]  leases   hash: offset -> lease deadline, epoch milliseconds
-- KEYS[5]  cascades set: offsets from which keys cascade, marked by an owner whose recovery walk
--          released before its end (SUB-4); kept until a walk ends
-- KEYS[6]  firsts   zset: first attempts, written a batch at a time: one member per value n (1 or
--          -1 as in attempts) listing the batch's runs of consecutive offsets,
--          '<first>,<last>,...,<first>,<last>,<n>', scored by its highest offset; an offset's field
--          in attempts, when it has one, was written after its run (a later attempt, a start);
--          members wholly below the floor are dropped with it
-- ARGV[1]  the caller's epoch
-- ARGV[2]  the runs of writes, "<key>,<COMMAND>;" each: KEYS[key] gets COMMAND with the arguments
--          of the run's own ARGV (ARGV[3] the first run's, and so on), a MessagePack array of
--          strings (unpacked in C by cmsgpack: one argument per run keeps the client's encoding cheap
--          for runs of hundreds of fields). The client makes the runs from the subscriber's state ops
--          (core/src/runs.rs gives each op's writes: attempts, leases, settles, cascade marks, the
--          floor and its trim); each key's runs come in the ops' order. Only the commands below, each on
--          its own key, are taken; a batch naming another is refused whole, before any write.
-- The attempts and leases hashes keep a field '_' that is not an offset (readers skip it), so that a
-- hash whose last offset is dropped is not deleted and created again by the next write: Redis 7.0
-- took ~10x longer per field to write 700 fields into a new hash than into one that exists
-- (645 vs 62 us per HSET, bench/RESULTS.md).
-- Returns 1 when applied, 0 when fenced (the stored epoch is higher: another owner claimed the
-- partition since), 2 when the stored epoch was gone or lower (Redis lost its state): the caller's
-- epoch is adopted and the ops applied. Claims hand out epochs above every earlier one (claim.lua),
-- so after a loss of Redis the latest claimer adopts last and fences every earlier owner for good;
-- what was lost can only cause redelivery, never loss (Kafka keeps the messages and the committed
-- offset). A batch that names a command this script does not take, or whose count of runs does not
-- match its arguments, gets an error reply and writes nothing.

local ALLOWED = {
  ['2,ZADD'] = true, ['2,ZREM'] = true, ['2,ZREMRANGEBYSCORE'] = true,
  ['3,HSET'] = true, ['3,HDEL'] = true, ['4,HSET'] = true, ['4,HDEL'] = true,
  ['5,SADD'] = true, ['5,SREM'] = true, ['6,ZADD'] = true, ['6,ZREMRANGEBYSCORE'] = true,
}
local runs = {}
for key, command in string.gmatch(ARGV[2], '(%d),(%u+);') do
  if not ALLOWED[key .. ',' .. command] then
    return redis.error_reply('apply.lua: ' .. command .. ' on KEYS[' .. key .. '] is not a state write')
  end
  runs[#runs + 1] = {tonumber(key), command}
end
if #runs ~= #ARGV - 2 then
  return redis.error_reply('apply.lua: ' .. #runs .. ' runs named, ' .. (#ARGV - 2) .. ' given')
end

local result = 1
local current = tonumber(redis.call('GET', KEYS[1]))
local epoch = tonumber(ARGV[1])
if not current or current < epoch then
  redis.call('SET', KEYS[1], ARGV[1])
  result = 2
elseif current > epoch then
  return 0
end
redis.call('HSETNX', KEYS[3], '_', '0')
redis.call('HSETNX', KEYS[4], '_', '0')
local CHUNK = 4000  -- arguments per call (even, so pairs stay whole); keeps unpack() within Lua's stack
for i, run in ipairs(runs) do
  local args = cmsgpack.unpack(ARGV[i + 2])
  for first = 1, #args, CHUNK do
    redis.call(run[2], KEYS[run[1]], unpack(args, first, math.min(first + CHUNK - 1, #args)))
  end
end
return result
