-- Cancel a scheduled message, only if no scheduler has claimed it for activation.
--
-- KEYS as in add.lua.
-- ARGV[1] schedule id, ARGV[2] now (ms)
-- Returns {'CANCELLED', record} when cancelled now, {'CANCELLED'} when cancelled before,
-- {'ALREADY_ENQUEUED'} when activated or claimed, {'REBUILD'} when the index is not built,
-- {'NOT_FOUND'} otherwise.
local id = ARGV[1]
if redis.call('ZSCORE', KEYS[1], id) then
  local record = redis.call('HGET', KEYS[3], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HSET', KEYS[4], id, 'CANCELLED')
  redis.call('ZADD', KEYS[5], ARGV[2], id)
  return {'CANCELLED', record or ''}
end
if redis.call('ZSCORE', KEYS[2], id) then
  return {'ALREADY_ENQUEUED'}
end
local state = redis.call('HGET', KEYS[4], id)
if state == 'ACTIVATED' then
  return {'ALREADY_ENQUEUED'}
elseif state == 'CANCELLED' then
  return {'CANCELLED'}
end
if redis.call('EXISTS', KEYS[6]) == 0 then
  return {'REBUILD'}
end
return {'NOT_FOUND'}
