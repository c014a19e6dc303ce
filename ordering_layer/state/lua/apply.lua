-- Apply a batch of subscriber state changes for one (subscription, partition), fenced by epoch.
--
-- KEYS[1]  epoch    string: owner epoch of the partition (INCR on each claim)
-- KEYS[2]  settled  zset: offsets acked or dead-lettered above the committed offset (score = offset)
-- KEYS[3]  attempts hash: offset -> delivery attempts so far (unsettled messages only)
-- KEYS[4]  leases   hash: offset -> lease deadline, epoch milliseconds
-- ARGV[1]  the caller's epoch
-- ARGV[2]  the ops, one string "kind,offset,value;" each (one argument keeps client-side encoding
--          cheap for batches of hundreds of ops):
--            "d" delivered: attempts[offset] = value (the attempt number); lease set by a later "l"
--            "l" lease:     leases[offset] = value (deadline ms)
--            "a" settled:   zadd settled offset; drop attempts and lease
--            "n" nack:      drop lease (the message stays unsettled)
--            "w" watermark: committed offset is value: forget everything below it
-- Returns 1 when applied, 0 when fenced (another owner claimed the partition), 2 when the epoch
-- key was gone (Redis lost its state): the caller's epoch is adopted and the ops applied; what was
-- lost can only cause redelivery, never loss (Kafka keeps the messages and the committed offset).
local result = 1
local current = redis.call('GET', KEYS[1])
if not current then
  redis.call('SET', KEYS[1], ARGV[1])
  current = ARGV[1]
  result = 2
end
if current ~= ARGV[1] then
  return 0
end
for kind, offset, value in string.gmatch(ARGV[2], '(%a),(%d+),(%d+);') do
  if kind == 'd' then
    redis.call('HSET', KEYS[3], offset, value)
  elseif kind == 'l' then
    redis.call('HSET', KEYS[4], offset, value)
  elseif kind == 'a' then
    redis.call('ZADD', KEYS[2], offset, offset)
    redis.call('HDEL', KEYS[3], offset)
    redis.call('HDEL', KEYS[4], offset)
  elseif kind == 'n' then
    redis.call('HDEL', KEYS[4], offset)
  elseif kind == 'w' then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. value)
  end
end
return result
