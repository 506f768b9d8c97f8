-- Stats. Returns {status, queued_groups, leased_groups, requeued_pending, oldest_group_age_ms,
-- counters (flat field/value list), config (flat field/value list)}; status NOJOB|OK.
if not job_exists() then
  return {'NOJOB'}
end
local now = now_ms()
local oldest_age_ms = 0
local first = redis.call('ZRANGE', K_QUEUE, 0, 0)
if #first > 0 then
  local info = read_info(first[1])
  if info then
    oldest_age_ms = math.max(0, now - info[I_PUSHED])
  end
end
return {'OK', redis.call('ZCARD', K_QUEUE), redis.call('HLEN', K_LEASES), redis.call('LLEN', K_REQUEUED),
  oldest_age_ms, redis.call('HGETALL', K_STATS), redis.call('HGETALL', K_CFG)}
