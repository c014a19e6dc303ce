-- Index a pending scheduled message for time (schedule(), or a rebuild from the schedule topic).
--
-- KEYS[1] due      zset: schedule id -> enqueue_at (ms)
-- KEYS[2] claimed  zset: schedule id -> lease deadline (ms) of the scheduler activating it
-- KEYS[3] entries  hash: schedule id -> the PENDING record (Avro)
-- KEYS[4] done     hash: schedule id -> ACTIVATED | CANCELLED
-- KEYS[5] done_at  zset: schedule id -> when it became done (ms)
-- KEYS[6] built    string: present while the index holds everything the topic holds
-- ARGV[1] schedule id, ARGV[2] enqueue_at (ms), ARGV[3] record
-- Returns 1 when indexed, 0 when the id is done or being activated already.
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 or redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
