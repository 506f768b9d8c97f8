-- PushGroup. ARGV: 1 group_id, 2 group bytes, 3 min span version (-1: none), 4 num_samples, 5 num_tokens,
-- 6 num_trainable, 7 trainable rewards all equal (1|0), 8 prompt_index, 9 epoch, 10 dedupe window ms,
-- 11 dedupe max ids, 12 max span version (-1: none).
-- Returns {outcome, num_queued_groups, filter reason}; outcome NOJOB|DUPLICATE|REJECTED|FILTERED|FULL|QUEUED.
if not job_exists() then
  return {'NOJOB', 0, ''}
end
local gid = ARGV[1]
if redis.call('HEXISTS', K_DATA, gid) == 1 or redis.call('ZSCORE', K_DONE, gid) then
  redis.call('HINCRBY', K_STATS, 'duplicate', 1)
  return {'DUPLICATE', redis.call('ZCARD', K_QUEUE), ''}
end
local now = now_ms()

local function finish(outcome, counter, reason)
  redis.call('ZADD', K_DONE, now, gid)
  trim_remembered(K_DONE, now, tonumber(ARGV[10]), tonumber(ARGV[11]))
  redis.call('HINCRBY', K_STATS, counter, 1)
  return {outcome, redis.call('ZCARD', K_QUEUE), reason}
end

local cfg = redis.call('HMGET', K_CFG, 'capacity_groups', 'group_filter', 'min_valid_samples')
local num_trainable = tonumber(ARGV[6])
if num_trainable == 0 then
  return finish('REJECTED', 'rejected_aborted', '')
end
if num_trainable < tonumber(cfg[3]) then
  return finish('FILTERED', 'filtered_too_few_valid', 'too_few_valid')
end
if cfg[2] == 'drop_equal_rewards' and ARGV[7] == '1' then
  return finish('FILTERED', 'filtered_equal_rewards', 'equal_rewards')
end
if redis.call('HLEN', K_DATA) >= tonumber(cfg[1]) then
  return {'FULL', redis.call('ZCARD', K_QUEUE), ''}
end
local seq = redis.call('INCR', K_SEQ)
local info = {seq, tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), now, 0, tonumber(ARGV[8]),
  tonumber(ARGV[9]), tonumber(ARGV[12])}
redis.call('HSET', K_DATA, gid, ARGV[2])
redis.call('HSET', K_INFO, gid, cmsgpack.pack(unpack(info)))
redis.call('ZADD', K_QUEUE, seq, gid)
count_queued(info, 1)
redis.call('HINCRBY', K_STATS, 'pushed', 1)
return {'QUEUED', redis.call('ZCARD', K_QUEUE), ''}
