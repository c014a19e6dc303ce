-- Mark a seek (GRP-3) applied in one partition: its owner has committed the seek's target in Kafka.
--
-- KEYS[1]  epoch  string: owner epoch of the partition
-- KEYS[2]  seek   hash: gen, offset, settled, applied (see claim.lua)
-- ARGV[1]  the owner's epoch: a fenced owner (another claimed the partition since) marks nothing
-- ARGV[2]  the generation applied
-- Returns 1 when marked, 0 when fenced or a generation as high was marked already.
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then
  return 0
end
if tonumber(redis.call('HGET', KEYS[2], 'applied') or '0') >= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[2], 'applied', ARGV[2])
return 1
