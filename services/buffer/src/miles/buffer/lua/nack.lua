-- Nack. ARGV: 1 discard (1|0), 2 consumer id (used when no lease ids are given), 3 dedupe window ms,
-- 4 dedupe max ids, 5.. lease ids. Leases that are not live are ignored.
-- Returns {status, num_returned}; status NOJOB|OK.
if not job_exists() then
  return {'NOJOB', 0}
end
local discard = ARGV[1] == '1'
local lids = {}
if #ARGV >= 5 then
  for i = 5, #ARGV do
    lids[#lids + 1] = ARGV[i]
  end
elseif ARGV[2] ~= '' then
  local all = redis.call('HGETALL', K_LEASES)
  for i = 1, #all, 2 do
    local _, consumer = cmsgpack.unpack(all[i + 1])
    if consumer == ARGV[2] then
      lids[#lids + 1] = all[i]
    end
  end
end
local now = now_ms()
local returned = 0
for _, lid in ipairs(lids) do
  local gid = end_lease(lid)
  if gid then
    if discard then
      forget_group(gid)
      redis.call('ZADD', K_DONE, now, gid)
    else
      return_to_queue(gid)
    end
    returned = returned + 1
  end
end
if returned > 0 then
  if discard then
    trim_remembered(K_DONE, now, tonumber(ARGV[3]), tonumber(ARGV[4]))
    redis.call('HINCRBY', K_STATS, 'discarded', returned)
  else
    redis.call('HINCRBY', K_STATS, 'nacked', returned)
  end
end
return {'OK', returned}
