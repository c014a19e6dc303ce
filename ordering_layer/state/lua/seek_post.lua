-- Record a seek (GRP-3) for one partition, unless a later seek is recorded already.
--
-- KEYS[1]  seek  hash: gen, offset, settled, applied (see claim.lua)
-- ARGV[1]  the seek's generation (from the subscription's counter: later seeks have higher ones)
-- ARGV[2]  the target offset: the partition restarts there
-- ARGV[3]  the offsets above the target that count as settled, comma-separated ('' for none)
-- Returns 1 when recorded, 0 when a later seek was recorded first (it wins). 'applied' is left
-- alone: the seek is pending until an owner (claim.lua) or the admin of an empty group applies it.
if tonumber(redis.call('HGET', KEYS[1], 'gen') or '0') >= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'gen', ARGV[1], 'offset', ARGV[2], 'settled', ARGV[3])
return 1
