-- Apply a batch of subscriber state changes for one (subscription, partition), fenced by epoch.
--
-- KEYS[1]  epoch    string: owner epoch of the partition (INCR on each claim)
-- KEYS[2]  settled  zset: offsets acked or dead-lettered above the committed offset (score = offset)
-- KEYS[3]  attempts hash: offset -> n, the number of the offset's last attempt (unsettled messages
--          only): n when user code has it (handed out by a pull, or started by a callback worker),
--          -n while it waits in a callback pool (user code not yet seen to start it)
-- KEYS[4]  leases   hash: offset -> lease deadline, epoch milliseconds
-- KEYS[5]  cascades set: offsets from which keys cascade, marked by an owner whose recovery walk
--          released before its end (SUB-4); kept until a walk ends
-- ARGV[1]  the caller's epoch
-- ARGV[2]  the ops, one string "kind,offset,value;" each (one argument keeps client-side encoding
--          cheap for batches of hundreds of ops); the kinds are the constants below, the same
--          letters as ordering_layer.state.store.OpKind:
--            DELIVERED       'd': attempts[offset] = value (the attempt number); lease by a later LEASE
--            LEASE           'l': leases[offset] = value (deadline ms)
--            BATCH_LEASE     'b': the lease deadline (value, ms) of the BATCH_* ops after it
--            BATCH_DELIVERED 'e': attempts[offset] = value; leases[offset] = the batch lease
--            RELEASED        'r': attempts[offset] = -value (in a callback pool); lease by a later LEASE
--            BATCH_RELEASED  'q': attempts[offset] = -value; leases[offset] = the batch lease
--            STARTED         's': attempts[offset] = value (a callback worker started user code on it)
--            SETTLED         'a': zadd settled offset; drop attempts and lease
--            NACKED          'n': drop lease (the message stays unsettled); a value above 0 is the
--                                 attempt user code nacked: attempts[offset] = value (it started)
--            UNSETTLED       'u': zrem settled offset (a settled record goes out again in a cascade)
--            CASCADE_FROM    'c': sadd cascades offset (the key of offset's record cascades from it)
--            CASCADE_DONE    'x': srem cascades offset (a walk ended: the mark is done with)
--            WATERMARK       'w': committed offset is value: forget everything settled below it
-- The attempts and leases hashes keep a field '_' that is not an offset (readers skip it), so that a
-- hash whose last offset is dropped is not deleted and created again by the next write: Redis 7.0
-- took ~10x longer per field to write 700 fields into a new hash than into one that exists
-- (645 vs 62 us per HSET, bench/RESULTS.md).
-- Returns 1 when applied, 0 when fenced (the stored epoch is higher: another owner claimed the
-- partition since), 2 when the stored epoch was gone or lower (Redis lost its state): the caller's
-- epoch is adopted and the ops applied. Claims hand out epochs above every earlier one (claim.lua),
-- so after a loss of Redis the latest claimer adopts last and fences every earlier owner for good;
-- what was lost can only cause redelivery, never loss (Kafka keeps the messages and the committed
-- offset).
--
-- Consecutive writes of one command to one key are sent as one multi-field call (HSET, HDEL, ZADD
-- with many pairs): the ops of a key keep their order (a run is sent before that key gets another
-- command), and different keys are independent, so the outcome is that of applying the ops one by
-- one, with a fraction of the calls (and of the AOF entries they propagate).
local DELIVERED, LEASE, BATCH_LEASE, BATCH_DELIVERED = 'd', 'l', 'b', 'e'
local RELEASED, BATCH_RELEASED, STARTED = 'r', 'q', 's'
local SETTLED, NACKED, UNSETTLED, WATERMARK = 'a', 'n', 'u', 'w'
local CASCADE_FROM, CASCADE_DONE = 'c', 'x'

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
local command = {}
local args = {{}, {}, {}, {}, {}}
local function send(k)
  local list = args[k]
  for i = 1, #list, CHUNK do
    redis.call(command[k], KEYS[k], unpack(list, i, math.min(i + CHUNK - 1, #list)))
  end
  args[k] = {}
end
local function add(k, name, a, b)
  if command[k] ~= name then
    send(k)
    command[k] = name
  end
  local list = args[k]
  list[#list + 1] = a
  if b then
    list[#list + 1] = b
  end
end
local batch_lease = nil
for kind, offset, value in string.gmatch(ARGV[2], '(%a),(%d+),(%d+);') do
  if kind == BATCH_DELIVERED then
    add(3, 'HSET', offset, value)
    add(4, 'HSET', offset, batch_lease)
  elseif kind == BATCH_RELEASED then
    add(3, 'HSET', offset, '-' .. value)
    add(4, 'HSET', offset, batch_lease)
  elseif kind == STARTED then
    add(3, 'HSET', offset, value)
  elseif kind == BATCH_LEASE then
    batch_lease = value
  elseif kind == DELIVERED then
    add(3, 'HSET', offset, value)
  elseif kind == RELEASED then
    add(3, 'HSET', offset, '-' .. value)
  elseif kind == LEASE then
    add(4, 'HSET', offset, value)
  elseif kind == SETTLED then
    add(2, 'ZADD', offset, offset)
    add(3, 'HDEL', offset)
    add(4, 'HDEL', offset)
  elseif kind == NACKED then
    add(4, 'HDEL', offset)
    if value ~= '0' then
      add(3, 'HSET', offset, value)
    end
  elseif kind == UNSETTLED then
    add(2, 'ZREM', offset)
  elseif kind == CASCADE_FROM then
    add(5, 'SADD', offset)
  elseif kind == CASCADE_DONE then
    add(5, 'SREM', offset)
  elseif kind == WATERMARK then
    send(2)
    command[2] = nil
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. value)
  end
end
for k = 2, 5 do
  send(k)
end
return result
