-- Ack. ARGV: 1 dedupe window ms, 2 dedupe max ids, 3.. lease ids.
-- A live lease (even one past its expiry that was not yet reaped: its group was not redelivered) removes its
-- group for good; a lease acked before counts as already acked; any other lease is reported as expired.
-- Returns {status, num_acked, num_already_acked, expired lease ids...}; status NOJOB|OK.
if not job_exists() then
  return {'NOJOB', 0, 0}
end
local now = now_ms()
local acked, already = 0, 0
local reply = {'OK', 0, 0}
for i = 3, #ARGV do
  local lid = ARGV[i]
  local gid = end_lease(lid)
  if gid then
    forget_group(gid)
    redis.call('ZADD', K_DONE, now, gid)
    redis.call('ZADD', K_ACKED, now, lid)
    acked = acked + 1
  elseif redis.call('ZSCORE', K_ACKED, lid) then
    already = already + 1
  else
    reply[#reply + 1] = lid
  end
end
if acked > 0 then
  trim_remembered(K_DONE, now, tonumber(ARGV[1]), tonumber(ARGV[2]))
  trim_remembered(K_ACKED, now, tonumber(ARGV[1]), tonumber(ARGV[2]))
  redis.call('HINCRBY', K_STATS, 'acked', acked)
end
reply[2], reply[3] = acked, already
return reply
