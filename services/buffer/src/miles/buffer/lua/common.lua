-- Prelude of every buffer script (store.py prepends it). One script is one atomic transition, so a crash of
-- the buffer process between two calls can neither lose nor duplicate a group.
--
-- KEYS (all of one job, sharing the hash tag {job_id}):
--  1 cfg          hash: capacity_groups, stale_policy, group_filter, min_valid_samples
--  2 data         hash: group_id -> serialized miles.common.v1.Group (queued and leased groups)
--  3 info         hash: group_id -> msgpack [seq, min_version, num_samples, num_tokens, pushed_ms, deliveries,
--                 prompt_index, epoch]
--  4 queue        zset: group_id scored by seq (push order; a returned group keeps its seq)
--  5 lease_expiry zset: lease_id scored by expiry (ms, Redis clock)
--  6 leases       hash: lease_id -> msgpack [group_id, consumer_id]
--  7 done         zset: finished group_id scored by finish time (ms): the dedupe window of pushes
--  8 acked        zset: acked lease_id scored by ack time (ms): the dedupe window of acks
--  9 requeued     list: msgpack [group_id, prompt_index, epoch] of stale groups under the requeue policy
-- 10 stats        hash: counters
-- 11 seq          string: sequence of pushes and lease ids
local K_CFG, K_DATA, K_INFO, K_QUEUE, K_EXPIRY, K_LEASES = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local K_DONE, K_ACKED, K_REQUEUED, K_STATS, K_SEQ = KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local I_SEQ, I_MINV, I_SAMPLES, I_TOKENS, I_PUSHED, I_DELIVERIES, I_PROMPT, I_EPOCH = 1, 2, 3, 4, 5, 6, 7, 8
-- Newest span version (-1: none); absent in groups pushed before it was kept (their oldest one stands in).
local I_MAXV = 9

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function job_exists()
  return redis.call('EXISTS', K_CFG) == 1
end

-- Keeps a zset of remembered ids within its time window and size bound (oldest forgotten first).
local function trim_remembered(key, now, window_ms, max_ids)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window_ms)
  local n = redis.call('ZCARD', key)
  if n > max_ids then
    redis.call('ZREMRANGEBYRANK', key, 0, n - max_ids - 1)
  end
end

local function read_info(gid)
  local raw = redis.call('HGET', K_INFO, gid)
  if not raw then
    return nil
  end
  return {cmsgpack.unpack(raw)}
end

local function count_queued(info, sign)
  redis.call('HINCRBY', K_STATS, 'queued_samples', sign * info[I_SAMPLES])
  redis.call('HINCRBY', K_STATS, 'queued_tokens', sign * info[I_TOKENS])
end

-- Puts a leased group back into the queue at its original place.
local function return_to_queue(gid)
  local info = read_info(gid)
  if info then
    redis.call('ZADD', K_QUEUE, info[I_SEQ], gid)
    count_queued(info, 1)
  end
end

-- Deletes a group that is neither queued nor leased any more.
local function forget_group(gid)
  redis.call('HDEL', K_DATA, gid)
  redis.call('HDEL', K_INFO, gid)
end

-- Ends a lease (by ack, nack or expiry); returns its group_id, or nil when the lease is not live.
local function end_lease(lid)
  local lease = redis.call('HGET', K_LEASES, lid)
  if not lease then
    return nil
  end
  redis.call('HDEL', K_LEASES, lid)
  redis.call('ZREM', K_EXPIRY, lid)
  local gid = cmsgpack.unpack(lease)
  return gid
end

-- Returns the groups of expired leases to the queue (at-least-once delivery); returns how many expired.
local function reap_expired(now, limit)
  local lids = redis.call('ZRANGEBYSCORE', K_EXPIRY, '-inf', now, 'LIMIT', 0, limit)
  for _, lid in ipairs(lids) do
    local gid = end_lease(lid)
    if gid then
      return_to_queue(gid)
    else
      redis.call('ZREM', K_EXPIRY, lid)
    end
  end
  if #lids > 0 then
    redis.call('HINCRBY', K_STATS, 'expired', #lids)
  end
  return #lids
end
