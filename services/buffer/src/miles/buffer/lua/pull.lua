-- PullBatch. ARGV: 1 num_groups, 2 min_groups, 3 trainer_version, 4 max_staleness, 5 lease ms,
-- 6 lease id prefix (random per call), 7 consumer id, 8 dedupe window ms, 9 dedupe max ids, 10 reap limit,
-- 11 max bytes of group data per reply (at least one group is always returned).
-- Lease ids are the prefix plus a number from the job's sequence, so that a re-executed script (a client
-- library resending it after a lost reply) makes new leases instead of overwriting the first execution's,
-- whose groups then simply come back when those leases expire.
-- Scans the queue oldest first; groups over the staleness bound are dropped or requeued (by the job's policy)
-- whatever else happens. Under the mask policy a group is over the bound only when its newest span is; one whose
-- oldest span is over it is leased at the bound's staleness and counted (the trainer masks the old spans).
-- When fewer than min_groups are eligible nothing is leased (status WAIT).
-- Returns {status, num_dropped, num_requeued, num_expired, lease_expires_ms, num_stale_masked,
--          then per leased group: lease_id, group bytes, staleness, redelivery_count}; status NOJOB|WAIT|OK.
if not job_exists() then
  return {'NOJOB', 0, 0, 0, 0, 0}
end
local now = now_ms()
local expired = reap_expired(now, tonumber(ARGV[10]))
local want, need = tonumber(ARGV[1]), tonumber(ARGV[2])
local version, bound = tonumber(ARGV[3]), tonumber(ARGV[4])
local policy = redis.call('HGET', K_CFG, 'stale_policy')
local requeue, mask = policy == 'requeue', policy == 'mask'
local max_bytes = tonumber(ARGV[11])
local chosen = {}
local chosen_bytes = 0
local dropped, requeued, masked = 0, 0, 0
local offset = 0
local chunk = math.max(want, 64)
local full = false
while #chosen < want and not full do
  local gids = redis.call('ZRANGE', K_QUEUE, offset, offset + chunk - 1)
  if #gids == 0 then
    break
  end
  for _, gid in ipairs(gids) do
    local info = read_info(gid)
    local staleness = 0
    if info[I_MINV] >= 0 then
      staleness = math.max(0, version - info[I_MINV])
    end
    if mask and staleness > bound and version - (info[I_MAXV] or info[I_MINV]) <= bound then
      staleness = -1 -- leased at the bound, counted as masked when leased
    end
    if staleness > bound then
      redis.call('ZREM', K_QUEUE, gid)
      count_queued(info, -1)
      forget_group(gid)
      if requeue then
        redis.call('RPUSH', K_REQUEUED, cmsgpack.pack(gid, info[I_PROMPT], info[I_EPOCH]))
        requeued = requeued + 1
      else
        redis.call('ZADD', K_DONE, now, gid)
        dropped = dropped + 1
      end
    else
      local size = redis.call('HSTRLEN', K_DATA, gid)
      if #chosen > 0 and chosen_bytes + size > max_bytes then
        full = true
        break
      end
      chosen[#chosen + 1] = {gid, staleness, info}
      chosen_bytes = chosen_bytes + size
      offset = offset + 1
      if #chosen >= want then
        break
      end
    end
  end
end
if dropped > 0 then
  trim_remembered(K_DONE, now, tonumber(ARGV[8]), tonumber(ARGV[9]))
  redis.call('HINCRBY', K_STATS, 'dropped_stale', dropped)
end
if requeued > 0 then
  redis.call('HINCRBY', K_STATS, 'requeued', requeued)
end
if #chosen < need or #chosen == 0 then
  return {'WAIT', dropped, requeued, expired, 0, 0}
end

local expires = now + tonumber(ARGV[5])
local reply = {'OK', dropped, requeued, expired, expires, 0}
local staleness_sum = 0
local staleness_max = tonumber(redis.call('HGET', K_STATS, 'staleness_max') or '0')
for _, entry in ipairs(chosen) do
  local gid, staleness, info = entry[1], entry[2], entry[3]
  if staleness < 0 then
    staleness = bound
    masked = masked + 1
  end
  local lid = ARGV[6] .. ':' .. redis.call('INCR', K_SEQ)
  redis.call('ZREM', K_QUEUE, gid)
  count_queued(info, -1)
  redis.call('ZADD', K_EXPIRY, expires, lid)
  redis.call('HSET', K_LEASES, lid, cmsgpack.pack(gid, ARGV[7]))
  local redeliveries = info[I_DELIVERIES]
  info[I_DELIVERIES] = redeliveries + 1
  redis.call('HSET', K_INFO, gid, cmsgpack.pack(unpack(info)))
  reply[#reply + 1] = lid
  reply[#reply + 1] = redis.call('HGET', K_DATA, gid)
  reply[#reply + 1] = staleness
  reply[#reply + 1] = redeliveries
  staleness_sum = staleness_sum + staleness
  staleness_max = math.max(staleness_max, staleness)
end
redis.call('HINCRBY', K_STATS, 'pulled', #chosen)
if masked > 0 then
  redis.call('HINCRBY', K_STATS, 'stale_masked', masked)
  reply[6] = masked
end
redis.call('HINCRBY', K_STATS, 'staleness_sum', staleness_sum)
redis.call('HSET', K_STATS, 'staleness_max', staleness_max)
return reply
